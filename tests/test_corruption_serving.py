"""Damaged cache files under a live server: flip, truncate, extend or splice bytes, restart.

A server populates a cache directory of whole files once (`ssd_layout="whole"`:
one file per conversation; damaged blocks are tests/test_integrity_default.py's
and tests/test_block_store.py's); every example copies it, damages one file, starts a server on the copy (with per-tensor verification, so every
byte of a file is checked) and asks for both conversations again. Whatever the
damage: no crash, each request succeeds with the tokens it would get without
the file, the damaged file is unlinked, the intact one still restores.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxd.kv import file_format as ff

from serving import ServerThread, config_for

CONVERSATIONS = [
    [{"role": "system", "content": "You catalogue seashells with great care. " * 12},
     {"role": "user", "content": "Which shell is rarest?"}],
    [{"role": "system", "content": "Every answer mentions a lighthouse keeper. " * 12},
     {"role": "user", "content": "What is the weather?"}],
]


def chat(server: ServerThread, messages: list) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def files(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.mlxkv"))


def owner(cache: Path, tokenizer, conversation: int) -> Path:
    """The one file holding `conversation` (told apart by its system prompt)."""
    system = CONVERSATIONS[conversation][0]["content"][:30]
    found = [p for p in files(cache) if system in tokenizer.decode(list(ff.read_header(p).tokens))]
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def template(tiny_model_dir, tiny_model, tmp_path_factory):
    """A cache dir holding one file per conversation, and the replies to expect."""
    cache = tmp_path_factory.mktemp("template") / "ssd"
    cold, warm = [], []
    with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=cache, ssd_layout="whole")) as server:
        for messages in CONVERSATIONS:
            cold.append(text(chat(server, messages)))  # a full prefill
            warm.append(text(chat(server, messages)))  # from the RAM tier, as a restore would be
        r = httpx.post(f"{server.base_url.removesuffix('/v1')}/admin/cache/flush", timeout=120)
        assert r.status_code == 200, r.text
    assert len(files(cache)) == 2
    owners = [owner(cache, tiny_model[1], i) for i in range(len(CONVERSATIONS))]
    return cache, [p.relative_to(cache) for p in owners], cold, warm


def _mutate(data: bytes, other: bytes, op: tuple) -> bytes:
    kind, a, b, c = op
    size = len(data)
    if kind == "flip":
        i = a % size
        return data[:i] + bytes([data[i] ^ (b % 255 + 1)]) + data[i + 1:]
    if kind == "truncate":
        return data[: a % size]
    if kind == "extend":
        return data + bytes([b % 256]) * (a % 5000 + 1)
    # splice: overwrite a run of our bytes with a run of another file's (or random) bytes
    start, length = a % size, c % 4096 + 1
    src = b % max(1, len(other) - length)
    piece = other[src: src + length] or bytes([b % 256]) * length
    return data[:start] + piece + data[start + len(piece):]


mutation = st.tuples(
    st.sampled_from(["flip", "truncate", "extend", "splice"]),
    st.integers(0, 2**31), st.integers(0, 2**31), st.integers(0, 2**31),
)


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(victim=st.sampled_from([0, 1]), ops=st.lists(mutation, min_size=1, max_size=3))
def test_damaged_files_are_unlinked_and_serving_continues(template, tiny_model_dir, tmp_path_factory, victim, ops):
    source, owners, cold, warm = template
    cache = tmp_path_factory.mktemp("damaged") / "ssd"
    shutil.copytree(source, cache)
    target = cache / owners[victim]
    other = (cache / owners[1 - victim]).read_bytes()
    original = data = target.read_bytes()
    for op in ops:
        data = _mutate(data, other, op)
    if data == original:
        return  # e.g. a splice of identical bytes: nothing was damaged
    target.write_bytes(data)

    config = config_for(tiny_model_dir, ssd_cache_dir=cache, ssd_cache_verify=True, ssd_layout="whole")
    with ServerThread(config) as server:
        for i, messages in enumerate(CONVERSATIONS):
            reply = chat(server, messages)
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            if i == victim:
                # The damaged file is never served (at most the few template tokens shared
                # with the other conversation's file are): the reply of a cold prefill.
                assert cached < 16
                assert text(reply) == cold[i]
            else:
                # The intact file still restores, exactly as the RAM tier served it.
                assert cached >= reply["usage"]["prompt_tokens"] - 1
                assert text(reply) == warm[i]
        stats = httpx.get(f"{server.base_url.removesuffix('/v1')}/stats", timeout=30).json()["ssd_cache"]
        assert stats["corrupt_removed"] >= 1
        assert httpx.get(f"{server.base_url.removesuffix('/v1')}/health", timeout=30).status_code == 200
    assert not target.exists()
    assert not list(cache.rglob("*.tmp"))
