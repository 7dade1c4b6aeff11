"""The startup device probe: measure prefill/decode/restore here, fit, and start the advisor from it.

GPU code paths run on CPU here (CI has no GPU): the probe drives the same
BatchGenerator, snapshot writer/reader and adopt as serving, on whatever
device MLX has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
import trio

from mlxd.kv.cost_model import CostModel
from mlxd.kv.device_costs import DeviceProbe, fit_linear, fit_prefill
from mlxd.kv.restore_decision import RestoreAdvisor
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.messages import SamplingParams
from mlxd.runtime.supervisor import open_runtime

KV = 114_688


def _points(model: CostModel, lengths: list[int]) -> tuple[tuple[int, float], ...]:
    return tuple((n, model.prefill_seconds(n, 0)) for n in lengths)


def test_fit_recovers_a_quadratic_prefill_cost():
    truth = CostModel(
        prefill_fixed=0.02, prefill_per_token=5e-5, prefill_per_pair=2e-9, decode_per_token=0.01,
        decode_per_pair=0.0, restore_fixed=0.0, restore_bytes_per_s=1e9, kv_bytes_per_token=KV,
    )
    fixed, a, b = fit_prefill(_points(truth, [64, 256, 1024, 4096]))
    assert fixed == pytest.approx(0.02, rel=1e-6)
    assert a == pytest.approx(5e-5, rel=1e-6)
    assert b == pytest.approx(2e-9, rel=1e-6)


def test_fit_never_returns_negative_coefficients():
    # Noisy small probes that a plain least-squares fit would answer with a negative term.
    fixed, a, b = fit_prefill([(64, 0.05), (256, 0.04), (1024, 0.2)])
    assert min(fixed, a, b) >= 0
    c, per_byte = fit_linear([(1 << 20, 0.002), (16 << 20, 0.011)])
    assert c >= 0 and per_byte > 0


def _gpu_like_probe() -> DeviceProbe:
    # The shape of what an H200 showed: 16k tokens in ~1.2 s of chunked prefill; restore ~1.5 GB/s.
    return DeviceProbe(
        device="Device(gpu, 0)",
        prefill=((64, 0.012), (256, 0.02), (1024, 0.06), (4096, 0.25), (8192, 0.55)),
        decode_s_per_token=0.009,
        restore=((7_340_032, 0.006), (939_524_096, 0.62)),
        kv_bytes_per_token=KV,
        prefill_step_size=2048,
    )


def test_an_advisor_started_from_a_gpu_probe_recomputes_long_prefixes_from_the_first_request():
    advisor = RestoreAdvisor(base=_gpu_like_probe().cost_model())
    predicted = advisor.prefill_seconds(16_000, 0)
    assert 0.5 < predicted < 3.0  # not the CPU model's tens of seconds
    # 16k cold tokens: ~1.2 s of prefill against ~1.2 s of restore + a short suffix: close;
    # with half the bandwidth it must recompute.
    slow = RestoreAdvisor(base=attrs_evolve_bw(_gpu_like_probe().cost_model(), 0.7e9))
    assert not slow.should_restore(
        restore_bytes=16_000 * KV, cold_tokens=16_000, warm_tokens=0, prompt_tokens=16_100
    )


def attrs_evolve_bw(model: CostModel, bw: float) -> CostModel:
    import attrs

    return attrs.evolve(model, restore_bytes_per_s=bw)


def test_a_cpu_probe_restores():
    cpu = DeviceProbe(
        device="Device(cpu, 0)",
        prefill=((64, 0.05), (256, 0.2), (1024, 1.1)),
        decode_s_per_token=0.012,
        restore=((1 << 20, 0.002), (16 << 20, 0.011)),
        kv_bytes_per_token=8192,
        prefill_step_size=2048,
    )
    advisor = RestoreAdvisor(base=cpu.cost_model())
    assert advisor.should_restore(restore_bytes=4000 * 8192, cold_tokens=4000, warm_tokens=0, prompt_tokens=4100)
    stats = cpu.as_dict()
    assert stats["restore_bytes_per_s"] > 1e9 and stats["prefill"][0] == {"tokens": 64, "seconds": 0.05}


async def test_startup_probe_measures_this_device_and_seeds_the_advisor(tiny_model_dir: Path, tmp_path: Path):
    ssd = tmp_path / "ssd"
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=ssd, device_probe_budget_s=1.0)
    async with open_runtime(config) as rt:
        probe = rt.info.probe
        assert probe is not None
        assert len(probe.prefill) >= 3 and all(s > 0 for _, s in probe.prefill)
        assert [n for n, _ in probe.prefill] == sorted(n for n, _ in probe.prefill)
        assert probe.decode_s_per_token > 0
        assert len(probe.restore) == 2 and probe.restore[1][0] > probe.restore[0][0]
        assert rt.cache_owner.tiers.advisor.base == probe.cost_model()
        stats = (await rt.stats()).as_dict()  # as /stats shows it
        assert stats["device_probe"]["device"] == probe.device
        assert stats["device_probe"]["cost_model"]["prefill_per_token"] == probe.cost_model().prefill_per_token
        # The probe's own snapshot files are gone; serving still works.
        # (blocks.lock: the serving store's own lock file, in the default layout; device-probe.json: the
        # measurements, for the next server here: kv/probe_file.py)
        leftovers = [p for p in ssd.rglob("*") if p.is_file() and p.name not in ("blocks.lock", "device-probe.json")]
        assert leftovers == []
        tokens = await rt.submit(rt.request(rt.encode("hello there"), sampling=SamplingParams(max_tokens=3))).tokens()
        assert len(tokens) == 3


async def test_probe_can_tune_the_prefill_chunk_size(tiny_model_dir: Path):
    config = RuntimeConfig(
        model=str(tiny_model_dir), device_probe="on", tune_prefill_step=True, device_probe_budget_s=0.5,
    )
    async with open_runtime(config) as rt:
        probe = rt.info.probe
        assert probe is not None and probe.restore == ()
        trials = dict(probe.step_trials)
        assert probe.prefill_step_size in trials
        assert trials[probe.prefill_step_size] == min(trials.values())
        assert rt.engine.core.generator.prefill_step_size == probe.prefill_step_size


async def test_no_probe_without_the_ssd_tier_by_default(tiny_model_dir: Path):
    async with open_runtime(RuntimeConfig(model=str(tiny_model_dir))) as rt:
        assert rt.info.probe is None
        assert "device_probe" not in (await rt.stats()).as_dict()
    await trio.lowlevel.checkpoint()


def test_blas_preload_is_skipped_where_mlx_has_its_cuda_backend(tmp_path: Path):
    # A real (empty) distribution record, as `pip install mlx[cuda13]` leaves one.
    dist = tmp_path / "mlx_cuda_13-0.32.4.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mlx-cuda-13\nVersion: 0.32.4\n")
    code = textwrap.dedent(
        """
        import json, sys
        import mlxd._blas as b
        print(json.dumps(b.preload()))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "MLXD_BLAS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", ""), str(Path(__file__).parents[1] / "src")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    status = json.loads(out.stdout.strip().splitlines()[-1])
    assert status["library"] is None and "mlx-cuda-13" in status["reason"]


def test_host_tier_promotions_set_the_host_bandwidth():
    # A CUDA probe with --host-cache-gb times the host tier's promotion; on unified memory it has none.
    gpu = DeviceProbe(
        device="Device(gpu, 0)", prefill=((64, 0.01), (1024, 0.02), (16384, 0.2)), decode_s_per_token=0.005,
        restore=((1 << 30, 0.7),), host=((1 << 30, 0.02), (2 << 30, 0.04)), kv_bytes_per_token=KV,
        prefill_step_size=2048,
    )
    assert gpu.cost_model().host_bytes_per_s == pytest.approx((3 << 30) / 0.06)
    assert gpu.as_dict()["host_bytes_per_s"] == round(gpu.cost_model().host_bytes_per_s)
    assert attrs.evolve(gpu, host=()).cost_model().host_bytes_per_s == 0.0


@pytest.mark.parametrize(("landing", "layout", "host_gb"), [("auto", "blocks", 1), ("host", "whole", 0)])
async def test_the_probe_restores_by_the_path_serving_uses(tiny_model_dir: Path, tmp_path: Path, landing, layout,
                                                          host_gb):
    from mlxd.actors.device_probe import lands_in_mlx

    config = RuntimeConfig(
        model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", device_probe_budget_s=0.2,
        restore_landing=landing, ssd_layout=layout, host_cache_bytes=host_gb << 30,
    )
    async with open_runtime(config) as rt:
        probe = rt.info.probe
        assert probe is not None and len(probe.restore) == 2
        want = "mlx" if lands_in_mlx(config) else "host"  # serving's rule; "auto" is "mlx" on this CPU
        assert want == ("mlx" if landing == "auto" else "host")
        assert (probe.restore_landing, probe.restore_layout) == (want, layout)
        assert probe.restores_into_mlx == (2 if want == "mlx" else 0)
        # --host-cache-gb on unified memory: no host copies to time, promotions cost nothing.
        assert probe.host == () and probe.cost_model().host_bytes_per_s == 0.0
        shown = (await rt.stats()).as_dict()["device_probe"]
        assert (shown["restore_landing"], shown["restore_layout"]) == (want, layout)
        assert list((tmp_path / "ssd").glob(".device-probe-*")) == []  # its own files are gone


async def test_the_probe_times_serving_s_own_restore_functions(tiny_model_dir: Path, tmp_path: Path, monkeypatch):
    # Spies on the functions serving restores with: the store's read (layout, readers, checks) on a
    # reader thread, the engine's landing on the engine's thread (as the prefetcher hands it over), and
    # the engine's adoption; the probe must go through them.
    import threading

    from mlxd.kv import kinds
    from mlxd.kv.ssd_store import SsdStore

    loads: list[dict] = []
    landings: list[str] = []
    adopts: list[object] = []
    real_load, real_adopt, real_landing = SsdStore.load, kinds.adopt, kinds.landing

    def load(self, record, **kw):
        loads.append({"verify": kw.get("verify"), "land": kw.get("land") is not None, "blocks": bool(record.blocks),
                      "readers": self.blocks.readers, "thread": threading.current_thread().name})
        return real_load(self, record, **kw)

    def landing(header):
        landings.append(threading.current_thread().name)
        return real_landing(header)

    def adopt(loaded, **kw):
        adopts.append((loaded, threading.current_thread().name))
        return real_adopt(loaded, **kw)

    monkeypatch.setattr(SsdStore, "load", load)
    monkeypatch.setattr(kinds, "landing", landing)
    monkeypatch.setattr(kinds, "adopt", adopt)
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", device_probe_budget_s=0.2)
    async with open_runtime(config) as rt:
        probe = rt.info.probe
        assert probe is not None
        # a warm-up, two cold restores, and each of them again from the page cache
        assert len(loads) == len(adopts) == len(landings) == 5
        from mlxd.kv.block_store import READERS

        assert all(c["land"] and c["verify"] is True and c["blocks"] and c["readers"] == READERS
                   and c["thread"] == "mlxd-probe-read" for c in loads)
        # the landing and the adoption on the engine's thread, not the reader's
        engine_threads = set(landings) | {t for _, t in adopts}
        assert len(engine_threads) == 1 and "mlxd-probe-read" not in engine_threads
        assert probe.restores_into_mlx == 2 and all(loaded.landed is not None for loaded, _ in adopts)
        assert len(probe.restore) == 2 and len(probe.restore_warm) == 2
        assert [b for b, *_ in probe.restore_parts] == [b for b, _ in probe.restore]
        assert all(min(parts) >= 0 for parts in probe.restore_parts)
        model = probe.cost_model()
        assert 0 < model.restore_bytes_per_s < float("inf") and 0 < model.page_cache_bytes_per_s < float("inf")
        assert rt.cache_owner.tiers.advisor.resident_bytes_per_s == model.page_cache_bytes_per_s
        shown = (await rt.stats()).as_dict()["device_probe"]
        assert shown["page_cache_bytes_per_s"] == round(model.page_cache_bytes_per_s)
        assert [p["bytes"] for p in shown["restore_parts"]] == [b for b, _ in probe.restore]


async def test_a_storage_failure_in_the_probe_leaves_the_default_restore_costs(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch, caplog
):
    from mlxd.kv.cost_model import DEFAULT
    from mlxd.kv.ssd_store import Failed, SsdStore

    monkeypatch.setattr(SsdStore, "write", lambda self, plan, *a, **kw: Failed("No space left on device"))
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", device_probe_budget_s=0.2)
    async with open_runtime(config) as rt:
        probe = rt.info.probe
        assert probe is not None and probe.restore == () and probe.restore_warm == ()
        model = probe.cost_model()
        assert (model.restore_fixed, model.restore_bytes_per_s) == (DEFAULT.restore_fixed, DEFAULT.restore_bytes_per_s)
        assert model.page_cache_bytes_per_s == 0.0 and len(probe.prefill) >= 3  # the rest was measured
        assert rt.cache_owner.tiers.advisor.restore_bytes_per_s == DEFAULT.restore_bytes_per_s
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "probe.restore_failed" in logged and "No space left on device" in logged


async def test_a_restarted_server_resumes_its_predecessor_s_restore_measurements(tiny_model_dir: Path, tmp_path: Path):
    from mlxd.kv import advisor_file

    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", device_probe_budget_s=0.2)
    async with open_runtime(config) as rt:
        advisor = rt.cache_owner.tiers.advisor
        advisor.observe_restore(nbytes=1 << 30, seconds=0.5)  # as a served restore reports it
        directory = rt.cold.store.directory if rt.cold is not None else None
    assert directory is not None and advisor_file.advisor_path(directory).exists()
    async with open_runtime(config) as rt:
        resumed = rt.cache_owner.tiers.advisor
        assert resumed.restore_samples == 1 and resumed.restore_bytes_per_s == pytest.approx((1 << 30) / 0.5)
        assert resumed.base == rt.info.probe.cost_model()  # the new probe's model, the old measurement
        assert (await rt.stats()).as_dict()["ssd_cache"]["restore_decisions"]["restore_samples"] == 1


def test_page_cache_points_without_a_slope_fall_back_to_the_largest_point_s_rate():
    # Noisy small points (the larger read as fast as the smaller): no positive slope to fit.
    probe = DeviceProbe(device="Device(cpu, 0)", prefill=((64, 0.01), (256, 0.02), (1024, 0.05)),
                        decode_s_per_token=0.01, restore=((1 << 20, 0.002), (16 << 20, 0.011)),
                        restore_warm=((1 << 20, 0.004), (16 << 20, 0.004)), kv_bytes_per_token=8192,
                        prefill_step_size=2048)
    assert probe.cost_model().page_cache_bytes_per_s == pytest.approx((16 << 20) / 0.004)


def test_a_restore_fit_without_a_slope_takes_the_largest_read_s_own_rate():
    # A loaded machine's small read slower than its large one: the fit has no per-byte cost, and the
    # bandwidth must not fall back to the built-in model's (another machine's) 7.8 GB/s.
    probe = DeviceProbe(
        device="Device(cpu, 0)", prefill=((64, 0.05), (256, 0.2), (1024, 1.1)), decode_s_per_token=0.01,
        restore=((1 << 20, 0.05), (64 << 20, 0.04)), kv_bytes_per_token=8192, prefill_step_size=2048,
    )
    model = probe.cost_model()
    assert model.restore_bytes_per_s == pytest.approx((64 << 20) / 0.04)
    assert model.restore_seconds(64 << 20) == pytest.approx(0.04)


async def test_a_landing_failure_in_the_probe_leaves_the_default_restore_costs(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch, caplog
):
    # The landing is allocated on the engine's thread while the reader waits (as the prefetcher hands it
    # over); its failure reaches the probe through the reader, and the server starts without restore points.
    from mlxd.kv import kinds
    from mlxd.kv.cost_model import DEFAULT

    def landing(header):
        raise RuntimeError("[malloc] Unable to allocate")

    monkeypatch.setattr(kinds, "landing", landing)
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", device_probe_budget_s=0.2)
    async with open_runtime(config) as rt:
        probe = rt.info.probe
        assert probe is not None and probe.restore == () and probe.restore_parts == ()
        assert probe.cost_model().restore_bytes_per_s == DEFAULT.restore_bytes_per_s
        assert list((tmp_path / "ssd").glob(".device-probe-*")) == []
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "probe.restore_failed" in logged and "Unable to allocate" in logged


@pytest.mark.parametrize(("budget_s", "timed", "warm"), [(float("inf"), 4, [1, 3]), (0.0, 3, [1, 2])])
def test_the_probe_s_largest_restore_is_timed_only_within_its_budget(tmp_path: Path, budget_s, timed, warm):
    # Real caches, a real store of serving's layout: points after the medium one are timed only where the
    # medium one, scaled to their size, predicts their write and read within the budget (a slow disk keeps
    # startup bounded); the page-cache re-reads are the first timed point's and the last one's.
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxd.actors.device_probe import RestorePath, _probe_restore

    def caches(n: int) -> list[KVCache]:
        out = []
        for _ in range(2):
            c = KVCache()
            c.update_and_fetch(mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 16)))
            out.append(c)
        return out

    points = [(16, caches(16)), (16, caches(16)), (256, caches(256)), (1024, caches(1024))]
    got = _probe_restore(RestorePath(directory=tmp_path, layout="blocks", block_tokens=256), points,
                         budget_s=budget_s)
    assert len(got) == timed
    assert [i for i, t in enumerate(got) if t.warm is not None] == warm
    assert [t.restore[0] for t in got] == [n * 2 * 2 * 16 * 4 * 2 for n, _ in points[:timed]]
    assert list(tmp_path.glob(".device-probe-*")) == []


async def test_the_probe_leaves_no_memory_files_or_threads_behind(tiny_model_dir: Path, tmp_path: Path):
    # Serving must start as a server that never ran the probe: the probe's KV caches and its generator's
    # buffers given back to the device (not held in MLX's buffer cache, where serving's first landings
    # could be carved from them), its snapshot files gone, its reader threads finished.
    import threading

    import mlx.core as mx

    ssd = tmp_path / "ssd"
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=ssd, device_probe_budget_s=0.5)
    async with open_runtime(config) as rt:
        probe = rt.info.probe
        assert probe is not None and len(probe.restore) >= 2
        longest = max(n for n, _ in probe.prefill) * probe.kv_bytes_per_token
        # (before: the probe's caches, each length's, were cached here after it returned)
        assert mx.get_cache_memory() < longest
        assert not [t for t in threading.enumerate() if t.name.startswith("mlxd-probe")]
        assert list(ssd.rglob(".device-probe-*")) == []
        tokens = await rt.submit(rt.request(rt.encode("hello there"), sampling=SamplingParams(max_tokens=3))).tokens()
        assert len(tokens) == 3


def test_a_saved_probe_reads_back_as_it_was_measured(tmp_path: Path):
    from mlxd.kv import probe_file

    probe = DeviceProbe(device="Device(gpu, 0)", prefill=((64, 0.0123456789), (256, 0.02), (1024, 0.05)),
                        decode_s_per_token=0.01, restore=((1 << 20, 0.002), (16 << 20, 0.011)),
                        restore_warm=((1 << 20, 0.001),), restore_parts=((1 << 20, 0.1, 0.2, 0.3),),
                        host=((1 << 20, 0.0001),), kv_bytes_per_token=8192, prefill_step_size=4096,
                        step_trials=((2048, 0.3), (4096, 0.2)), seconds=8.4, restore_landing="mlx")
    path = tmp_path / "fp" / probe_file.FILE_NAME
    setup = {"device": "Device(gpu, 0)", "budget_s": 3.0}
    probe_file.save(path, probe, setup)
    back = probe_file.load(path, setup)
    assert back is not None and back.reused and attrs.evolve(back, reused=False) == probe
    assert back.cost_model() == probe.cost_model()
    assert probe_file.load(path, {**setup, "budget_s": 1.0}) is None  # another setup: measure again
    path.write_text("{not json")
    assert probe_file.load(path, setup) is None
    assert probe_file.load(tmp_path / "missing.json", setup) is None


def test_a_damaged_saved_probe_is_measured_again_never_a_failed_start(tmp_path: Path):
    # A flipped byte can still be JSON: "16777216" -> "16e77216" reads as infinity (int() raised
    # OverflowError out of load: the server did not start); a field of the wrong type passed load and
    # failed later (the prefill chunk size, the decode rate in /stats).
    from mlxd.kv import probe_file

    probe = DeviceProbe(device="Device(gpu, 0)", prefill=((64, 0.01), (256, 0.02), (1024, 0.05)),
                        decode_s_per_token=0.01, restore=((1 << 20, 0.002), (16 << 20, 0.011)),
                        kv_bytes_per_token=8192, prefill_step_size=4096, seconds=8.4)
    path = tmp_path / "fp" / probe_file.FILE_NAME
    setup = {"device": "Device(gpu, 0)", "budget_s": 3.0}
    probe_file.save(path, probe, setup)
    good = path.read_text()
    assert "16777216" in good
    path.write_text(good.replace("16777216", "16e77216"))
    assert probe_file.load(path, setup) is None
    for field, bad in (("decode_s_per_token", None), ("decode_s_per_token", "x"), ("prefill_step_size", 0),
                       ("prefill_step_size", -1), ("prefill_step_size", "x"), ("prefill_step_size", 1e400),
                       ("seconds", None), ("kv_bytes_per_token", 1e400), ("device", 3)):
        data = json.loads(good)
        data["probe"][field] = bad
        path.write_text(json.dumps(data))
        assert probe_file.load(path, setup) is None, (field, bad)
    path.write_text(good)
    assert probe_file.load(path, setup) is not None


async def test_a_restarted_server_reuses_its_predecessor_s_probe_unless_told_to_measure(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
):
    # A restart on the same device and setup measures the same again (8.4 s of its start on the H200,
    # and GBs of its own files through the disk serving restores from): it reuses the saved probe.
    from mlxd.actors import device_probe

    runs: list[int] = []
    real = device_probe.probe_device

    def counted(*a, **kw):
        runs.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(device_probe, "probe_device", counted)
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", device_probe_budget_s=0.2)
    async with open_runtime(config) as rt:
        first = rt.info.probe
        assert first is not None and not first.reused and len(runs) == 1
    async with open_runtime(config) as rt:
        again = rt.info.probe
        assert again is not None and again.reused and len(runs) == 1
        assert attrs.evolve(again, reused=False) == first
        assert rt.cache_owner.tiers.advisor.base == first.cost_model()
        assert (await rt.stats()).as_dict()["device_probe"]["reused"] is True
        tokens = await rt.submit(rt.request(rt.encode("hello there"), sampling=SamplingParams(max_tokens=3))).tokens()
        assert len(tokens) == 3
    for changed in (attrs.evolve(config, device_probe="on"), attrs.evolve(config, device_probe_budget_s=0.3)):
        async with open_runtime(changed) as rt:  # told to measure, or another setup: measured afresh
            assert rt.info.probe is not None and not rt.info.probe.reused
    assert len(runs) == 3


async def test_the_warm_up_runs_the_probe_s_longest_prefill_by_serving_s_own_paths(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
):
    # The warm-up is a real prefill of the probe's longest length in whole serving chunks on a prompt's own
    # caches (the path of an overlapped restore's head and a prompt prefilled apart), and, in a process that
    # reused the saved probe (no forward run there), through the serving generator with two decode steps;
    # /stats says it ran. "auto" runs it on a GPU only: this CPU server skips it.
    from mlxd.actors import device_probe
    from mlxd.engine import core

    batch: list[tuple[int, int]] = []
    apart: list[tuple[int, int, int]] = []
    run, step = device_probe._run, core.prefill_step

    def counted_run(generator, prompt, *, decode):
        batch.append((len(prompt), generator.prefill_step_size))
        return run(generator, prompt, decode=decode)

    def counted_step(model, caches, prompt, at, until, size):
        apart.append((at, until, size))
        return step(model, caches, prompt, at, until, size)

    monkeypatch.setattr(device_probe, "_run", counted_run)
    monkeypatch.setattr(core, "prefill_step", counted_step)
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", device_probe_budget_s=0.2,
                           device_warmup="on", prefill_step_size=64, tune_prefill_step=False)
    async with open_runtime(config) as rt:  # measured: the probe's own prefills ran the batch's shapes
        first = rt.info.probe
        longest = first.prefill[-1][0]
        assert first is not None and not first.reused and first.warmup_tokens == longest and first.warmup_s > 0
        assert apart == [(at, longest, 64) for at in range(0, longest, 64)]
        assert (await rt.stats()).as_dict()["device_probe"]["warmup"] == {"tokens": longest,
                                                                         "seconds": round(first.warmup_s, 3)}
    batch.clear()
    apart.clear()
    async with open_runtime(config) as rt:  # reused: no forward ran, so the batch's too
        again = rt.info.probe
        assert again is not None and again.reused
        assert batch == [(longest, 64)]
        assert apart == [(at, longest, 64) for at in range(0, longest, 64)]
        assert again.warmup_tokens == longest and again.warmup_s > 0
        tokens = await rt.submit(rt.request(rt.encode("hello there"), sampling=SamplingParams(max_tokens=3))).tokens()
        assert len(tokens) == 3
    batch.clear()
    apart.clear()
    async with open_runtime(attrs.evolve(config, device_warmup="auto")) as rt:  # auto: on a GPU only
        assert rt.info.probe is not None and rt.info.probe.reused and rt.info.probe.warmup_tokens == 0
        assert (batch, apart) == ([], [])
        assert (await rt.stats()).as_dict()["device_probe"]["warmup"] is None
    # the warm-up is this process's, not the device's: the next server does not read it back
    saved = json.loads(next((tmp_path / "ssd").rglob("device-probe.json")).read_text())
    assert "warmup_tokens" not in json.dumps(saved) and "warmup_s" not in json.dumps(saved)


async def test_a_saved_probe_is_reused_whatever_memory_the_device_has_free(tiny_model_dir: Path, tmp_path: Path,
                                                                           monkeypatch):
    # CUDA's device_info reports the device's free memory, which every process on it moves: part of the
    # saved probe's setup, it made a restart's reuse luck (H100 2026-12-06 20:52 / 20:56: 3 of 20 restarted
    # processes reused it, the rest measured again, ~6 s each). The device's own properties still decide.
    import mlx.core as mx

    info = {"device_name": "NVIDIA H100 80GB HBM3", "total_memory": 85_000_000_000, "free_memory": 84_000_000_000}
    monkeypatch.setattr(mx, "device_info", lambda: dict(info))
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", device_probe_budget_s=0.2)
    async with open_runtime(config) as rt:
        assert rt.info.probe is not None and not rt.info.probe.reused
    info["free_memory"] = 61_234_567_890
    async with open_runtime(config) as rt:
        assert rt.info.probe is not None and rt.info.probe.reused
    info["total_memory"] = 150_000_000_000  # another device: measured afresh
    async with open_runtime(config) as rt:
        assert rt.info.probe is not None and not rt.info.probe.reused


def test_device_warmup_on_needs_the_probe():
    with pytest.raises(ValueError, match="--device-warmup on .* needs the probe"):
        RuntimeConfig(model="m", device_probe="off", device_warmup="on")
    assert RuntimeConfig(model="m", device_probe="off").device_warmup == "auto"  # auto: nothing to warm


def test_a_restore_as_prefetched_runs_the_callers_work_only_after_handing_the_landing(tmp_path: Path):
    # probe_restore_paths.py --busy: this thread's forward passes run while the reader fills the landing,
    # never before it was handed (the landing would wait behind them); the read is the same either way.
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from mlxd.actors.device_probe import load_as_prefetched
    from mlxd.kv import kinds
    from mlxd.kv.ssd_store import SsdStore, StoreIdentity, compute_fingerprint

    identity = StoreIdentity("probe", compute_fingerprint({"probe": "meanwhile"}), "probe")
    store = SsdStore(tmp_path, identity, layout="blocks", block_tokens=64)
    caches = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, 512, 16)), mx.random.normal((1, 2, 512, 16)))
        caches.append(c)
    record = store.write(kinds.plan_snapshot(caches, meta=identity.meta(range(512), ""))).record
    events: list[str] = []

    def land(header):
        events.append("land")
        return kinds.landing(header)

    def meanwhile() -> None:
        events.append("meanwhile")
        mx.eval(mx.random.normal((64, 64)) @ mx.random.normal((64, 64)))

    loaded, landing_s = load_as_prefetched(store, record, verify=True, land=land, meanwhile=meanwhile)
    assert loaded is not None and loaded.landed is not None and landing_s > 0
    assert events[0] == "land" and events.count("land") == 1
    adopted = kinds.adopt(loaded)
    np.testing.assert_array_equal(np.array(adopted[1].keys[..., :512, :]), np.array(caches[1].keys[..., :512, :]))
