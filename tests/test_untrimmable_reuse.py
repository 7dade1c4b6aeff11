"""Recurrent and hybrid models keep their reuse on a repeated turn and after a restart (issue 27).

Their checkpoints cannot be cut back, so the end-of-turn checkpoint (prompt +
reply) serves only a prompt that starts with exactly those ids. Two cases
used to fall short of `mlx_lm.server`: a regenerated turn (the same prompt
again) found only the previous turn's checkpoint, and after a restart the
next turn re-tokenized the reply and missed its end-of-turn checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from mlxd.model import build_model

from serving import ServerThread, config_for

SYSTEM = "You answer briefly and keep every cached prefix. " * 4
NO_EOS = {"0": -100, "1": -100, "2": -100}


@pytest.fixture(scope="module", params=["test-mamba2", "test-qwen3next"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / request.param, request.param, seed=0)


def chat(server: ServerThread, messages: list[dict], **kw) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, "logit_bias": NO_EOS, **kw}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_repeated_turn_reuses_its_prompt_boundary(model_dir: Path) -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a prefix?"}]
    # the default threshold: a turn adding few tokens would take no prompt-boundary snapshot
    with ServerThread(config_for(model_dir, snapshot_min_tokens=256)) as server:
        first = chat(server, turn1)
        turn2 = [*turn1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And a suffix?"}]
        chat(server, turn2)
        again = chat(server, turn2)  # regenerate: the same prompt a second time
        assert cached(again) == again["usage"]["prompt_tokens"] - 1


def test_the_end_of_turn_checkpoint_serves_the_next_turn_after_a_restart(model_dir: Path, tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a prefix?"}]
    with ServerThread(config_for(model_dir, ssd_cache_dir=ssd)) as server:
        first = chat(server, turn1)
        reply = first["choices"][0]["message"]["content"]
        httpx.post(f"{server.base_url.removesuffix('/v1')}/admin/cache/flush", timeout=120).raise_for_status()
    end_of_turn = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And a suffix?"}]
    with ServerThread(config_for(model_dir, ssd_cache_dir=ssd)) as restarted:
        got = chat(restarted, turn2)  # a new process: no reply history, the reply text is re-tokenized
        assert cached(got) >= end_of_turn


def test_index_offers_entries_that_part_where_the_prompt_leaves_it() -> None:
    from mlxd.kv.prefix_index import PrefixIndex

    index = PrefixIndex()
    index.insert((1, 2, 3, 4, 5), "end of turn", trimmable=False)
    index.insert((1, 2), "boundary", trimmable=False)
    index.insert((9, 9), "elsewhere", trimmable=True)
    assert index.diverging((1, 2, 3, 7, 8)) == ["end of turn"]  # parts inside its edge
    assert index.longest_usable((1, 2, 3, 7, 8), limit=4).value == "boundary"  # not usable as is
    assert index.diverging((1, 2, 6)) == ["end of turn"]  # parts right after a stored node
    assert index.diverging((5,)) == []
