"""In-flight generation checkpoints (seed §5.7): the pure key/record/queue, and resumes across real restarts."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import attrs
import pytest

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.kv import file_format as ff
from mlxd.kv import gen_checkpoint as gc
from mlxd.kv import kinds
from mlxd.runtime.kernel.messages import TokenGenerated
from mlxd.structured.spec import constraint_from_request

from procs import ServeProcess, kill_mid_request

NO_EOS = ((0, -100.0), (2, -100.0))  # the tiny model's EOS ids never win: generations run to max_tokens


# --- pure parts -----------------------------------------------------------------------


def test_request_key_covers_prompt_namespace_and_every_sampling_field():
    base = SamplingParams(max_tokens=64, temperature=0.7, seed=3)
    key = gc.request_key((1, 2, 3), "", base)
    assert key == gc.request_key((1, 2, 3), "", SamplingParams(max_tokens=64, temperature=0.7, seed=3))
    assert key != gc.request_key((1, 2, 4), "", base)
    assert key != gc.request_key((1, 2, 3), "adapter", base)
    changes = {
        "temperature": 0.8, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "seed": 4, "max_tokens": 65, "stop_token_ids": (7,),
        "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1,
        "repetition_context_size": 5,
        "logit_bias": ((1, 2.0),), "logprobs": True, "top_logprobs": 1,
        "constraint": constraint_from_request({"regex": "[a-z]+"}),
    }
    assert set(changes) == {f.name for f in attrs.fields(SamplingParams)}, "a new sampling field must be keyed"
    for name, value in changes.items():
        assert gc.request_key((1, 2, 3), "", attrs.evolve(base, **{name: value})) != key, name


def test_logprob_requests_are_not_checkpointed():
    assert gc.checkpointable(SamplingParams())
    assert not gc.checkpointable(SamplingParams(logprobs=True))
    assert not gc.checkpointable(SamplingParams(top_logprobs=2))


def test_record_round_trips_through_a_real_file_header(tmp_path, tiny_model):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = tiny_model
    caches = make_prompt_cache(model)
    tokens = [5, 6, 7, 8, 9]
    model(mx.array([tokens]), cache=caches)
    record = gc.GenerationRecord(key="k" * 32, prompt_tokens=3, emitted=tokens[3:], pending=42, rng_key=(1, 2))
    meta = ff.SnapshotMeta(model_id="m", config_fingerprint="f", namespace="", tokenizer_hash="t", tokens=tokens,
                           generation=record.as_doc())
    written = ff.write_snapshot(kinds.plan_snapshot(caches, meta=meta), tmp_path / gc.file_name(record.key))
    header = ff.read_header(written.path)
    assert gc.GenerationRecord.from_header(header.meta.generation, header.meta.tokens) == record
    with pytest.raises(ValueError):
        gc.GenerationRecord.from_header(header.meta.generation, header.meta.tokens[:-1])
    with pytest.raises(ValueError):
        gc.GenerationRecord.from_header(None, header.meta.tokens)


def test_queue_keeps_the_newest_job_and_lets_only_the_owner_remove():
    q = gc.CheckpointQueue()
    q.write(gc.WriteJob("a", "r1", _Plan(10), 8))
    q.write(gc.WriteJob("a", "r1", _Plan(20), 16))
    assert len(q) == 1 and q.superseded == 1 and q.pending_bytes() == 20
    q.write(gc.WriteJob("a", "r2", _Plan(30), 8))  # a newer attempt of the same request key
    assert not q.remove("a", "r1"), "an older attempt's cleanup must not erase the newer one"
    assert q.remove("a", "r2") and q.removing("a")
    job = q.take()
    assert isinstance(job, gc.RemoveJob) and q.take() is None
    q.adopt("b", "r3")  # r3 resumed b's checkpoint
    assert q.owned("b"), "a live request owns it: no one else resumes it"
    assert not q.remove("b", "r-old") and q.remove("b", "r3")
    q.write(gc.WriteJob("c", "r4", _Plan(5), 16))
    q.release("c", "r4")  # r4 was cancelled: its checkpoint stays, resumable
    assert not q.owned("c") and len(q) == 2


@attrs.frozen
class _Plan:
    nbytes: int


# --- in a runtime: client drop, retry resumes -----------------------------------------------


async def test_a_dropped_client_leaves_a_checkpoint_that_the_retry_resumes(tiny_model_dir, tmp_path):
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", generation_checkpoint=16)
    for sampling in (
        SamplingParams(max_tokens=90, logit_bias=NO_EOS),
        SamplingParams(max_tokens=90, temperature=0.9, top_p=0.95, seed=5, logit_bias=NO_EOS),
        # History-dependent processors see prompt + emitted tokens after a resume too.
        SamplingParams(max_tokens=90, temperature=0.7, seed=9, repetition_penalty=2.0, presence_penalty=2.0,
                       frequency_penalty=1.0, logit_bias=NO_EOS),
    ):
        async with open_runtime(config) as rt:
            ckpt = rt.cold.checkpointer
            prompt = rt.encode("Please keep talking about durable caches for a while. " * 2)
            async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
                full = await stream.tokens()
            await _settle(ckpt)
            assert ckpt.stats["written"] >= 1 and not list(ckpt.directory.glob("*.mlxgen")), "completion removes it"

            # The client goes away twice: the second attempt resumes the first one's checkpoint
            # and checkpoints further; each time the last checkpoint stays.
            for drop_at in (40, 70):
                seen = []
                async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
                    async for event in stream:
                        if isinstance(event, TokenGenerated):
                            seen.append(event.token)
                            if len(seen) == drop_at:
                                break
                assert seen == full[:drop_at]
                await _settle(ckpt)
                assert len(list(ckpt.directory.glob("*.mlxgen"))) == 1, "the last checkpoint stays"

            async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
                again = await stream.tokens()
                assert stream.accepted.cache_tier == "checkpoint"
                assert stream.accepted.cached_tokens == len(prompt)
                assert stream.finished.completion_tokens == len(full)
            assert again == full
            assert ckpt.stats["resumed"] == 2
            await _settle(ckpt)
            assert not list(ckpt.directory.glob("*.mlxgen"))


async def _settle(ckpt) -> None:
    """Wait until the checkpointer has nothing queued and no live owner (polling counters: no event exists).

    A dropped request's checkpoint becomes resumable once the engine has seen the drop
    (at its next step) and released the key: on a loaded machine that can be later
    than the last write.
    """
    import trio

    with trio.fail_after(60):
        # `writing`: a removal taken off the queue (pending 0) may still be unlinking on a loaded machine
        while any(ckpt.snapshot_stats()[k] for k in ("pending", "owned", "writing")):  # noqa: ASYNC110
            await trio.sleep(0.02)
        await trio.sleep(0.05)


# --- real processes: SIGKILL mid-generation, restart, the same request resumes exactly ---------


def _serve(tmp_path: Path, model_dir: Path, cache: Path, name: str) -> ServeProcess:
    return ServeProcess("--model", str(model_dir), "--model-name", "tiny", "--ssd-cache", str(cache),
                        "--generation-checkpoint", "32", log_path=tmp_path / f"{name}.log")


def _body(**kw) -> dict:
    return {"model": "tiny", "prompt": "Tell the long story of a cache that survived a crash. " * 3,
            "max_tokens": 500, "logit_bias": {"0": -100, "2": -100}, **kw}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 1234, "top_k": 50}],
                         ids=["greedy", "seeded"])
def test_sigkill_mid_generation_then_restart_resumes_to_the_uninterrupted_text(tmp_path, tiny_model_dir, sampling):
    body = _body(**sampling)
    with _serve(tmp_path, tiny_model_dir, tmp_path / "ref", "ref") as ref, ref.client() as http:
        reference = http.post("/v1/completions", json=body).json()
    assert reference["usage"]["completion_tokens"] == 500

    cache = tmp_path / "ssd"
    kill_mid_request(_serve(tmp_path, tiny_model_dir, cache, "first").start(), "/v1/completions", body)
    files = list(cache.rglob("*.mlxgen"))
    assert len(files) == 1
    emitted = ff.read_header(files[0]).meta.generation["emitted"]
    assert 0 < emitted < 500

    with _serve(tmp_path, tiny_model_dir, cache, "second") as second, second.client() as http:
        again = http.post("/v1/completions", json=body).json()
        stats = http.get("/stats").json()["generation_checkpoints"]
        assert stats["resumed"] == 1
        assert again["choices"][0]["text"] == reference["choices"][0]["text"]
        assert again["usage"]["completion_tokens"] == 500
        assert again["choices"][0]["finish_reason"] == "length"
        # The resumed response is one ordinary response; a later identical request starts fresh.
        deadline = time.monotonic() + 60
        while list(cache.rglob("*.mlxgen")):
            assert time.monotonic() < deadline, "completion must remove the checkpoint"
            time.sleep(0.05)
    assert "gen_checkpoint.resume" in second.log()


def _wait_settled(http) -> dict:
    deadline = time.monotonic() + 60
    while True:
        stats = http.get("/stats").json()["generation_checkpoints"]
        if stats["pending"] == 0 and stats["entries"] == 0:
            return stats
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_stream_resumes_with_the_saved_tokens_first(tmp_path, tiny_model_dir):
    """A streamed retry after a network drop gets the saved tokens, then the rest, as one stream."""
    body = _body(max_tokens=600, stream=True, temperature=0)
    with _serve(tmp_path, tiny_model_dir, tmp_path / "ssd", "drop") as proc, proc.client() as http:
        plain = http.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]["text"]
        written = _wait_settled(http)["written"]
        with http.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                now = http.get("/stats").json()["generation_checkpoints"]
                if now["written"] > written and now["entries"] >= 1:
                    break  # leaving the block drops the connection
        # The server notices the drop and frees the slot (the retry then decodes alone, as the
        # uninterrupted run did: a different batch cohort is not a bitwise identity).
        deadline = time.monotonic() + 60
        while http.get("/stats").json()["scheduler"]["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        text = ""
        with http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"] if json.loads(line[6:])["choices"] else ""
        assert text == plain
        assert http.get("/stats").json()["generation_checkpoints"]["resumed"] == 1
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 0
    assert not list((tmp_path / "ssd").rglob("*.mlxgen")), "a graceful shutdown leaves no checkpoint behind"


async def test_a_damaged_checkpoint_is_removed_and_the_request_runs_from_the_start(tiny_model_dir, tmp_path):
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", generation_checkpoint=16)
    sampling = SamplingParams(max_tokens=400, logit_bias=NO_EOS)
    async with open_runtime(config) as rt:
        prompt = rt.encode("A checkpoint that will not survive the disk. " * 2)
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            async for event in stream:
                if isinstance(event, TokenGenerated) and rt.cold.checkpointer.snapshot_stats()["entries"]:
                    break
        await _settle(rt.cold.checkpointer)
        (path,) = rt.cold.checkpointer.directory.glob("*.mlxgen")
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF  # inside the hashed header
    path.write_bytes(bytes(raw))
    (path.parent / "orphan.mlxgen.tmp").write_bytes(b"half a write")
    async with open_runtime(config) as rt:
        assert not list(path.parent.iterdir()), "the damaged file and the tmp orphan are reaped at startup"
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            tokens = await stream.tokens()
            assert stream.accepted.cache_tier != "checkpoint"
        assert len(tokens) == 400 and rt.cold.checkpointer.stats["resumed"] == 0


async def test_a_live_identical_request_is_never_resumed_from(tiny_model_dir, tmp_path):
    """n identical unseeded samples must stay independent: only an abandoned checkpoint is resumed."""
    import trio

    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", generation_checkpoint=16)
    sampling = SamplingParams(max_tokens=400, temperature=1.0, logit_bias=NO_EOS)  # no seed
    async with open_runtime(config) as rt:
        prompt = rt.encode("Two samples of the same prompt. " * 2)
        tiers: list[str] = []

        async def sample(wait_for_checkpoint: bool) -> None:
            if wait_for_checkpoint:
                with trio.fail_after(60):
                    while not rt.cold.checkpointer.snapshot_stats()["entries"]:  # noqa: ASYNC110
                        await trio.sleep(0.005)
            async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
                await stream.tokens()
                tiers.append(stream.accepted.cache_tier)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample, False)
            nursery.start_soon(sample, True)
        assert "checkpoint" not in tiers and rt.cold.checkpointer.stats["resumed"] == 0


async def test_a_flush_waits_for_queued_checkpoint_work(tiny_model_dir, tmp_path):
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", generation_checkpoint=8)
    async with open_runtime(config) as rt:
        prompt = rt.encode("Flush me. " * 4)
        async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=200, logit_bias=NO_EOS))) as s:
            await s.tokens()
        report = await rt.flush()  # right after completion: its removal may still be queued
        assert report["durable"] and report["generation_checkpoints_pending"] == 0
        stats = rt.cold.checkpointer.snapshot_stats()
        assert stats["pending"] == 0 and stats["entries"] == 0 and stats["removed"] >= 1
        assert not list(rt.cold.checkpointer.directory.glob("*.mlxgen"))
        assert "generation_checkpoints" not in rt.cold.governor.urgent
