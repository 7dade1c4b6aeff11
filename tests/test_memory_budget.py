"""The memory budget in a live runtime: durable entries demote to SSD, or are evicted without one."""

from __future__ import annotations

import ast

import httpx
import pytest
import trio

from mlxd import GenerationError, RuntimeConfig, SamplingParams, open_runtime
from mlxd.runtime.config import PHYSICAL_SHARE, default_memory_budget, physical_memory_bytes
from test_engine_errors import POISON, poison

from serving import ServerThread, config_for

SYSTEM = "Answer like a librarian who keeps every long conversation in mind. " * 10


async def conversations(rt, n: int) -> list[tuple[int, ...]]:
    return [
        await rt.render_chat([{"role": "system", "content": f"Conversation {i}. " + SYSTEM},
                              {"role": "user", "content": "Where were we?"}])
        for i in range(n)
    ]


async def answer(rt, prompt: tuple[int, ...]):
    sampling = SamplingParams(max_tokens=4, logprobs=True)
    async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
        events = [e async for e in stream if hasattr(e, "logprob")]
    return [e.token for e in events], [e.logprob for e in events], stream.accepted


async def test_over_the_budget_durable_entries_demote_and_come_back_from_ssd(tiny_model_dir, tmp_path):
    # 1 byte: the weights alone pass it, so every durable entry must leave RAM.
    config = RuntimeConfig(
        model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", snapshot_min_tokens=16,
        memory_budget_bytes=1, ssd_demote_idle_s=0,
    )
    async with open_runtime(config) as rt:
        assert rt.info.memory_budget_bytes == 1
        prompts = await conversations(rt, 3)
        first = [await answer(rt, p) for p in prompts]
        assert (await rt.flush())["durable"]
        with trio.fail_after(60):  # each commit is followed by a budget check in the cache owner
            while len(rt.cache_owner.cache):  # noqa: ASYNC110 - polling an actor from a test
                await trio.sleep(0.05)
        stats = await rt.stats()
        memory = stats.cache.tiers.memory
        assert memory.budget_bytes == 1
        assert 0 < memory.active_bytes <= memory.max_active_bytes <= memory.peak_active_bytes
        assert memory.demotions >= 3 and memory.evictions == 0 and memory.freed_bytes > 0
        assert stats.ssd.dropped_spills == 0
        assert stats.cache.tiers.dropped_unpersisted == 0
        # Every conversation comes back from SSD with the same tokens and logprobs.
        for p, (tokens, logprobs, _) in zip(prompts, first, strict=True):
            again, again_lp, accepted = await answer(rt, p)
            assert accepted.cache_tier == "ssd" and accepted.cached_tokens == len(p) - 1
            assert again == tokens and again_lp == logprobs


def test_without_ssd_the_budget_evicts_and_stats_show_it(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, memory_budget_bytes=1)) as server:
        root = server.base_url.removesuffix("/v1")
        body = {"model": "tiny", "messages": [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": "Which shelf?"}],
                "temperature": 0, "max_tokens": 5}
        replies = []
        for _ in range(2):
            r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            replies.append(r.json())
        # Nothing stays in RAM, so the follow-up is computed afresh, with the same text.
        assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]
        stats = httpx.get(f"{root}/stats", timeout=30).json()
        memory = stats["cache"]["memory"]
        assert memory["evictions"] >= 2 and memory["demotions"] == 0
        assert stats["cache"]["ram"]["entries"] == 0 and memory["cache_bytes"] == 0
        assert memory["over_bytes"] > 0  # the weights alone pass 1 byte: nothing left to free
        metrics = httpx.get(f"{root}/metrics", timeout=30).text
        assert "mlxd_memory_budget_bytes 1.0" in metrics


async def test_the_default_budget_is_a_share_of_the_machine_and_moves_nothing(tiny_model_dir):
    async with open_runtime(RuntimeConfig(model=str(tiny_model_dir), snapshot_min_tokens=16)) as rt:
        assert rt.info.memory_budget_bytes == default_memory_budget({}, physical_memory_bytes())  # CPU: RAM
        (prompt,) = await conversations(rt, 1)
        await answer(rt, prompt)
        _, _, accepted = await answer(rt, prompt)
        assert accepted.cache_tier == "ram"
        memory = (await rt.stats()).cache.tiers.memory
        assert memory.over_bytes < 0 and memory.freed_bytes == 0 and memory.measurements >= 2


def test_default_budget_prefers_the_recommended_working_set():
    assert default_memory_budget({"max_recommended_working_set_size": 1000, "memory_size": 4000}, 8000) == 900
    assert default_memory_budget({"memory_size": 4000}, 8000) == int(4000 * PHYSICAL_SHARE)
    assert default_memory_budget({"total_memory": 2000, "free_memory": 10}, 8000) == int(2000 * PHYSICAL_SHARE)  # CUDA
    assert default_memory_budget({}, 8000) == int(8000 * PHYSICAL_SHARE)


def test_memory_budget_flag(tmp_path):
    from mlxd.cli import build_parser, serve_config

    args = build_parser().parse_args(["serve", "--memory-budget", "1.5"])
    assert serve_config(args).memory_budget_bytes == int(1.5 * 1024**3)
    assert serve_config(build_parser().parse_args(["serve"])).memory_budget_bytes is None
    assert serve_config(build_parser().parse_args(["serve", "--memory-budget", "0"])).memory_budget_bytes == 0


CACHE_PROBE = """
import sys
import mlx.core as mx
from mlxd.engine.loading import keep_buffer_cache_to

if sys.argv[1] != "none":
    print(keep_buffer_cache_to(int(sys.argv[1])))
held = [mx.ones(((4 << 20) // 4,)) + i for i in range(20)]  # 80 MiB at once, then freed
mx.eval(held)
del held
print(mx.get_cache_memory())
"""


def _cache_after(budget: str) -> list[str]:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CACHE_PROBE, budget], capture_output=True, text=True, check=True)
    return done.stdout.split("\n")


def test_the_budget_bounds_mlx_buffer_cache_in_a_process():
    # MLX keeps freed buffers up to its own cache limit (32 MiB on its CPU build, nearly the GPU on CUDA);
    # under a budget the cache keeps to an eighth of it.
    MiB = 1 << 20
    unbounded = int(_cache_after("none")[0])
    assert unbounded > 8 * MiB  # what the bound below must take away
    limits, cached = _cache_after(str(64 * MiB))[:2]
    limit, before = ast.literal_eval(limits)
    assert limit == 8 * MiB and before >= limit
    assert int(cached) <= 8 * MiB
    # A budget whose eighth passes MLX's own limit leaves MLX's (never a larger cache than MLX keeps).
    limit, before = ast.literal_eval(_cache_after(str(1 << 40))[0])
    assert limit == before < (1 << 40) // 8


async def test_the_runtime_sets_the_buffer_cache_limit_and_gives_it_back(tiny_model_dir):
    import mlx.core as mx

    def current() -> int:  # MLX reads its cache limit only by setting one
        value = mx.set_cache_limit(0)
        mx.set_cache_limit(value)
        return int(value)

    before = current()
    budget = 64 << 20
    async with open_runtime(RuntimeConfig(model=str(tiny_model_dir), memory_budget_bytes=budget)) as rt:
        assert rt.info.memory_budget_bytes == budget
        assert current() == min(budget // 8, before)
        (prompt,) = await conversations(rt, 1)
        await answer(rt, prompt)
        memory = (await rt.stats()).cache.tiers.memory
        assert 0 <= memory.buffer_cache_bytes <= budget // 8 + (4 << 20)  # the limit, and one buffer past it
        poison(rt)  # a failed step and the reset after it keep the limit
        with pytest.raises(GenerationError, match="poisoned forward"):
            await rt.submit(rt.request([5, 6, POISON, 8], sampling=SamplingParams(max_tokens=4))).tokens()
        await answer(rt, prompt)
        assert rt.engine.stats.failed_steps == 1 and current() == min(budget // 8, before)
    assert current() == before
    async with open_runtime(RuntimeConfig(model=str(tiny_model_dir), memory_budget_bytes=0)):
        assert current() == before  # no budget: MLX's own


async def _pool_usage(rt, trims: int, deadline: float = 30.0):
    """The cache owner's view of the device pool once it has seen `trims` trims (waits for the measurement)."""
    with trio.fail_after(deadline):
        while True:
            pool = (await rt.stats()).cache.tiers.memory.device_pool
            if pool is not None and pool.trims >= trims:
                return pool
            await trio.sleep(0.02)


@pytest.mark.parametrize("switch", ["on", "off", "waiting"])
async def test_an_idle_engine_trims_the_gpu_memory_pool_once_after_work(tiny_model_dir, monkeypatch, switch):
    from mlxd.actors import engine as engine_actor
    from mlxd.kv.tiers import PoolUsage
    from mlxd.runtime.device_memory import DevicePool
    from test_device_memory import _Pool

    monkeypatch.setattr(engine_actor, "IDLE_TRIM_S", 60.0 if switch == "waiting" else 0.3)
    if switch == "off":
        monkeypatch.setenv("MLXD_POOL_TRIM", "0")
    MiB, budget = 1 << 20, 64 << 20
    async with open_runtime(RuntimeConfig(model=str(tiny_model_dir), memory_budget_bytes=budget)) as rt:
        core = rt.engine.core
        assert core._pool is None and not core.trims_when_idle  # the CPU has no pool: nothing to trim
        cuda = _Pool(reserved=900 * MiB, used=100 * MiB)
        core._pool = DevicePool(cuda)  # as MLX's CUDA build leaves it after a peak
        (prompt,) = await conversations(rt, 1)
        await answer(rt, prompt)
        if switch != "on":  # MLXD_POOL_TRIM=0, or not idle long enough yet (a next turn may come): the peak stays
            await trio.sleep(1.0)
            assert cuda.trims == [] and cuda.reserved == 900 * MiB
            return
        pool = await _pool_usage(rt, trims=1)
        # What MLX uses plus one buffer-cache share of the budget stays; the rest goes back to the device.
        assert cuda.trims == [100 * MiB + budget // 8]
        assert pool == PoolUsage(108 * MiB, 100 * MiB, trims=1, trimmed_bytes=792 * MiB)
        from mlxd.http.metrics import _cache_families

        samples = {s.name: s.value for f in _cache_families((await rt.stats()).cache) for s in f.samples}
        assert samples["mlxd_memory_device_pool_reserved_bytes"] == 108 * MiB
        assert samples["mlxd_memory_device_pool_trimmed_bytes_total"] == 792 * MiB
        await trio.sleep(1.0)
        assert len(cuda.trims) == 1  # once per idle spell
        cuda.reserved = 500 * MiB  # the next request's peak
        await answer(rt, prompt)
        pool = await _pool_usage(rt, trims=2)
        assert cuda.trims == [108 * MiB] * 2 and pool.trimmed_bytes == (792 + 392) * MiB
