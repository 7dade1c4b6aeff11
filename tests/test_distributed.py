"""One model sharded over two processes (`mlx.launch`, ring backend on loopback) serves the same tokens."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mlxd.cli import build_parser, serve_config
from mlxd.engine.core import EngineCore
from mlxd.engine.ops import RowStart, StepOps
from mlxd.engine.ranks import Leader
from mlxd.kv.prompt_cache import CacheEntry, CacheHit
from mlxd.kv.shard_mirror import FollowerShards, MissingShard, PrefixRef, ShardRef, shard_key
from mlxd.runtime.distributed import StepChannel, decode_ops, encode_ops, pin_seed
from mlxd.runtime.kernel.messages import GenerationRequest, PromptAccepted, SamplingParams

from procs import ServeProcess
from serving import ServerThread, config_for

LAUNCH = (str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", "2",
          "--hosts", "127.0.0.1", "--")
PROMPT = [(7 * i + 3) % 900 + 10 for i in range(40)]
REQUESTS = [  # greedy with logprobs (compared closely), seeded sampling, and a batch of two
    {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3},
    {"prompt": PROMPT[:25], "max_tokens": 12, "temperature": 2.0, "seed": 7, "logprobs": 1},
]
BATCH = [{"prompt": PROMPT[i:i + 20], "max_tokens": 6 + i, "temperature": 0} for i in range(2)]
# Conversations with their own system prompts (no shared prefix), greedy, with logprobs.
SYSTEMS = {"a": "You are a careful assistant who answers briefly. " * 6,
           "b": "NOTEBOOK. You keep careful notes of what the user says. " * 6}
CHAT = {"model": "tiny", "temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 3,
        "logit_bias": {"0": -100, "2": -100}}
# A RAM cap (75 kB) that holds one conversation's checkpoint on a rank's shard (256 bytes a
# token here, at most ~240 tokens) but not two, so that conversation b evicts conversation a.
SMALL_CACHE_GB = "0.00007"


def run_requests(base: str) -> list[dict]:
    with httpx.Client(base_url=base, timeout=120) as http:
        def complete(body: dict) -> dict:
            r = http.post("/completions", json={"model": "tiny", **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        out = [complete(body) for body in REQUESTS]
        with ThreadPoolExecutor(len(BATCH)) as pool:
            out += list(pool.map(complete, BATCH))
    return out


def run_conversations(base: str) -> list[dict]:
    """a's turns 1 and 2 (2 extends 1: a hit), b's turn 1 (evicts a under the small cap), a's turn 3."""
    chats = {k: [{"role": "system", "content": v}] for k, v in SYSTEMS.items()}
    questions = [("a", "Name a colour."), ("a", "And another?"), ("b", "Remember: blue."), ("a", "One more?")]
    out = []
    with httpx.Client(base_url=base, timeout=120) as http:
        for who, question in questions:
            chats[who].append({"role": "user", "content": question})
            r = http.post("/chat/completions", json={**CHAT, "messages": chats[who]})
            assert r.status_code == 200, r.text
            reply = r.json()
            chats[who].append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
            out.append(reply)
        out.append(http.get(base.removesuffix("/v1") + "/stats").json())
    return out


def same_answers(single: dict, sharded: dict) -> None:
    """The same tokens, and every reported logprob within 1e-3."""
    a, b = single["choices"][0], sharded["choices"][0]
    assert a["message"]["content"] == b["message"]["content"] and a["finish_reason"] == b["finish_reason"]
    for x, y in zip(a["logprobs"]["content"], b["logprobs"]["content"], strict=True):
        assert x["token"] == y["token"] and x["logprob"] == pytest.approx(y["logprob"], abs=1e-3)
        top_x, top_y = ({t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in (x, y))
        assert top_x.keys() == top_y.keys()
        assert all(top_x[k] == pytest.approx(top_y[k], abs=1e-3) for k in top_x)


def cached(reply: dict) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def log_events(log: str, event: str) -> list[dict]:
    pattern = r'^\{.*"' + re.escape(event) + r'".*\}$'
    return [json.loads(line) for line in re.findall(pattern, log, re.M)]


def test_two_ranks_serve_the_single_process_tokens(tiny_model_dir, tmp_path):
    """Tokens as one process (prompt cache on), and the RAM tier mirrored: hits and evictions on every rank."""
    with ServerThread(config_for(tiny_model_dir)) as server:
        single = run_requests(server.base_url)
        single_chat = run_conversations(server.base_url)

    with ServeProcess("--distributed", "--model", str(tiny_model_dir), "--model-name", "tiny",
                      "--prompt-cache-gb", SMALL_CACHE_GB, log_path=tmp_path / "ranks.log", launcher=LAUNCH) as ranks:
        sharded = run_requests(ranks.url + "/v1")
        sharded_chat = run_conversations(ranks.url + "/v1")
        with ranks.client() as http:  # the evictions' drops have reached the follower (an idle step)
            deadline = time.monotonic() + 60
            while (now := http.get("/stats").json())["engine"]["mirrored_prefixes"] != now["cache"]["ram"]["entries"]:
                assert time.monotonic() < deadline, now
                time.sleep(0.05)
        started = {e["rank"]: e for e in log_events(ranks.log(), "engine.distributed")}
        assert started.keys() == {0, 1} and started[1]["world_size"] == 2
        assert ranks.log().count('"mode": "tcp"') == 2  # steps go over the side channel (idle followers sleep)
        # Stopping rank 0 stops the run: it drains, tells the follower to stop, and every rank exits 0.
        os.kill(started[0]["pid"], signal.SIGTERM)
        assert ranks.wait(timeout=60) == 0, ranks.log()
        assert "serve.shutdown" in ranks.log()

    # The conversation: the same answers; turn 2 started from turn 1's checkpoint on both ranks (a
    # start from a prefix the follower did not hold fails its step); b's turn evicted a, whose turn 3
    # (which would have started from the evicted checkpoint) starts cold (or from the few template
    # tokens it shares with b's checkpoint), with the same tokens.
    *single_turns, _ = single_chat
    *turns, stats = sharded_chat
    for a, b in zip(single_turns, turns, strict=True):
        same_answers(a, b)
    assert cached(turns[1]) >= turns[0]["usage"]["total_tokens"] - 1
    assert cached(turns[3]) < turns[1]["usage"]["total_tokens"] - 1 <= cached(single_turns[3])  # a's is gone
    assert stats["cache"]["ram"]["evictions"] > 0 and stats["engine"]["failed_steps"] == 0
    assert stats["engine"]["mirror_misses"] == 0  # every hit rank 0 got was held by the follower
    [follower] = log_events(ranks.log(), "engine.follower_shards")
    assert follower["rank"] == 1 and follower["missing"] == 0
    assert follower["hits"] >= 1 and follower["dropped"] >= 1  # it lent turn 1's shard, dropped the evicted ones
    assert follower["entries"] == stats["cache"]["ram"]["entries"]  # it holds a shard of each entry rank 0 holds

    for a, b in zip(single, sharded, strict=True):
        assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"]
    greedy_single, greedy_sharded = single[0]["logprobs"], sharded[0]["logprobs"]
    assert greedy_single["tokens"] == greedy_sharded["tokens"]
    for top_a, top_b in zip(greedy_single["top_logprobs"], greedy_sharded["top_logprobs"], strict=True):
        assert top_a.keys() == top_b.keys()  # the same runners-up, with the same logprobs
        assert all(top_a[k] == pytest.approx(top_b[k], abs=1e-3) for k in top_a)
    sampled_single, sampled_sharded = single[1]["logprobs"], sharded[1]["logprobs"]
    assert sampled_single["tokens"] == sampled_sharded["tokens"]
    assert len(set(sampled_single["token_logprobs"])) > 1  # sampling drew varied tokens, identically on both
    assert sampled_single["token_logprobs"] == pytest.approx(sampled_sharded["token_logprobs"], abs=1e-3)


def test_step_ops_round_trip_and_seeds_are_pinned():
    s = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, stop_token_ids=(3, 4), logit_bias=((5, -1.5),))
    sampled = pin_seed(GenerationRequest(request_id="a", prompt=(1, 2, 3), sampling=s, namespace="ns"))
    assert sampled.sampling.seed is not None
    greedy = GenerationRequest(request_id="b", prompt=(9,), session="s1")
    assert pin_seed(greedy) is greedy
    starts = (RowStart(request=sampled), RowStart(request=greedy))
    ops = StepOps(starts=starts, cancels=("a",), stops=("b", "c"))
    assert decode_ops(encode_ops(ops)) == ops and not ops.lends
    assert decode_ops(encode_ops(StepOps(shutdown=True))).shutdown
    # With the prompt cache: the prefix each start lends (or None), and the prefixes rank 0's owner dropped.
    cached = StepOps(starts=starts, prefixes=(None, PrefixRef("ab" * 16, 7, 9)), drops=(ShardRef("cd" * 16, 3),))
    assert decode_ops(encode_ops(cached)) == cached and cached.lends
    reset = StepOps(reset=True, drops=(ShardRef("k", 1),), discard=True)
    assert decode_ops(encode_ops(reset)) == reset
    # A chat template's stable prefix travels with its request and its start's cuts: every rank cuts alike.
    cut = GenerationRequest(request_id="c", prompt=tuple(range(40)), checkpoint_at=(20,))
    with_cuts = StepOps(starts=(RowStart(request=cut, checkpoint_at=(20, 30)),))
    assert decode_ops(encode_ops(with_cuts)) == with_cuts
    # What only rank 0 holds (its RAM prefix, a restore, a queue time) never goes on the wire.
    entry = CacheEntry("", (1, 2), None, 0, True, 0.0, 0.0)
    local = StepOps(starts=(RowStart(request=greedy, hit=CacheHit(entry, 1), queued_s=0.5),))
    assert decode_ops(encode_ops(local)) == StepOps(starts=(RowStart(request=greedy),))
    with pytest.raises(ValueError, match="2 prefixes for 1 starts"):
        StepOps(starts=(RowStart(request=greedy),), prefixes=(None, None))


class _Pair:
    """The rank and size of a two-rank group (what StepChannel asks of MLX's group)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2


def test_rank0_fails_a_step_that_lends_a_prefix_a_follower_lacks(tiny_model_dir):
    """The follower's answer before the step (real sockets): rank 0 fails it, drops the key, starts later hits cold."""
    core = EngineCore(config_for(tiny_model_dir))
    core.load()
    ours, theirs = socket.socketpair()
    # A world of two whose side channel is a socket pair (steps never reach an all_sum here).
    channel, follower = StepChannel(_Pair(0), None), StepChannel(_Pair(1), None)
    channel._peers, follower._leader = [ours], theirs
    leader = Leader(core, channel, mirrored=True)
    prompt = (5, 6, 7, 8, 9, 10)
    entry = CacheEntry("", prompt[:4], None, 0, True, 0.0, 0.0)
    key = shard_key("", prompt[:4])
    leader._mirror.published(key)  # rank 0 believes every follower holds it
    request = GenerationRequest(request_id="r", prompt=prompt, sampling=SamplingParams(max_tokens=2))
    start = RowStart(request=request, hit=CacheHit(entry, 4))

    seen: list[StepOps] = []

    def follow(steps: int) -> None:
        shards = FollowerShards()  # holds nothing: the key is missing here
        for _ in range(steps):
            ops = follower.receive()
            seen.append(ops)
            if ops.lends:
                follower.confirm(len(shards.missing_keys(ops.prefixes)))

    try:
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(follow, 3)
            with pytest.raises(MissingShard, match="follower rank lacks"):
                leader.step(StepOps(starts=(start,)))
            leader.step(StepOps(reset=True))
            result = leader.step(StepOps(starts=(start,)))  # the same hit again: started cold on every rank
            done.result(timeout=60)
    finally:
        core.close()
        channel.close()
        follower.close()
    assert seen[0].prefixes == (PrefixRef(key, 4, 4),)
    # The followers drop it too; no step ran, so the checkpoints of the last one stand (no discard).
    assert seen[1].reset and [r.key for r in seen[1].drops] == [key] and not seen[1].discard
    assert seen[2].prefixes == () and seen[2].starts[0].hit is None and not leader._mirror.holds(key)
    assert [e.event.cached_tokens for e in result.emits if isinstance(e.event, PromptAccepted)] == [0]
    assert result.stats.mirror_misses == 1


def test_distributed_keeps_the_ram_tier_and_refuses_the_ssd_tier():
    with pytest.raises(ValueError, match="in RAM only for now"):
        serve_config(build_parser().parse_args(["serve", "--distributed", "--ssd-cache", "/tmp/x"]))
    config = serve_config(build_parser().parse_args(["serve", "--distributed", "--prompt-cache-gb", "0.5"]))
    assert config.distributed and config.prompt_cache_bytes == 2**29 and config.device_probe == "off"
