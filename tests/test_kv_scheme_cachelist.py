"""A KV scheme reaches the attention inside hybrid layers (issue 27).

falcon_h1 keeps each layer's attention KV inside a `CacheList` beside its
recurrent state. `--kv-bits 8` used to leave those layers at full precision
without a word (the SSD bytes were identical with and without it). Now the
KVCache inside the list is quantized like any other: the SSD files say so and
are smaller, and a restore answers what a same-scheme cold prefill answers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_cache_kinds_serving import cached, chat, conversation, flush, same

from models import falcon_h1_dir
from serving import ServerThread, config_for
from ssd_files import stored_bytes, tensor_headers


@pytest.fixture(scope="module")
def falcon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return falcon_h1_dir(tiny_model_dir, tmp_path_factory.mktemp("models") / "falcon_h1")


def test_kv8_quantizes_attention_inside_cache_lists(falcon: Path, tmp_path: Path) -> None:
    turn1, turn2, _ = conversation()
    sizes = {}
    for bits in (None, 8):
        ssd = tmp_path / f"ssd-{bits}"
        with ServerThread(config_for(falcon, ssd_cache_dir=ssd, kv_bits=bits)) as server:
            chat(server, turn1)
            flush(server)
        headers = tensor_headers(ssd)
        assert headers
        signatures = {s for h in headers for s in h.signature}
        assert any("quant:8" in s for s in signatures) == (bits == 8), signatures
        sizes[bits] = stored_bytes(ssd)
    assert sizes[8] < sizes[None], sizes


def test_kv8_falcon_restore_matches_same_scheme_recompute(falcon: Path, tmp_path: Path) -> None:
    turn1, turn2, _ = conversation()
    with ServerThread(config_for(falcon, prompt_cache_bytes=0, kv_bits=8)) as cold:
        chat(cold, turn1)
        want = chat(cold, turn2)
        assert cached(want) == 0
    ssd = tmp_path / "ssd"
    with ServerThread(config_for(falcon, ssd_cache_dir=ssd, kv_bits=8)) as server:
        chat(server, turn1)
        warm = chat(server, turn2)
        assert cached(warm) > 0
        same(warm, want)
        flush(server)
    with ServerThread(config_for(falcon, ssd_cache_dir=ssd, kv_bits=8)) as restarted:
        restored = chat(restarted, turn2)
        assert cached(restored) > 0
        same(restored, want)
