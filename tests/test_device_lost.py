"""A device that fails for good (a poisoned CUDA context: every step, resets included, raises): the engine stops
stepping, answers every request with why, /health says so, and `mlxd serve` stops and exits 1 (the H100 at
09:53 2026-12-07: a server went on failing four steps a second, every request answered 500, /health ok)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
import trio

import device_fault
from mlxd import GenerationError, RuntimeConfig, SamplingParams, open_runtime

from procs import ServeProcess
from serving import ServerThread, config_for

LAUNCHER = [sys.executable, str(Path(__file__).with_name("device_fault.py"))]


async def test_a_lost_device_stops_the_engine_and_every_request_gets_why(tiny_model_dir, monkeypatch):
    device_fault.install_with(monkeypatch)
    config = RuntimeConfig(model=str(tiny_model_dir), model_name="tiny")
    async with open_runtime(config) as rt:
        async with rt.submit(rt.request(rt.encode("hello"), sampling=SamplingParams(max_tokens=3))) as ok:
            assert len(await ok.tokens()) == 3  # the device works until the poisoned prompt
        assert rt.engine.device_lost is None
        with trio.fail_after(60):
            with pytest.raises(GenerationError, match="illegal memory access"):
                await rt.submit(rt.request([5, 6, device_fault.POISON, 8], sampling=SamplingParams(max_tokens=4))).tokens()
            await rt.engine.lost.wait()  # three resets failed in a row
        assert rt.engine.device_lost.startswith("the device failed: RuntimeError: cudaStreamSynchronize")
        failed = rt.engine.stats.failed_steps
        assert failed == 1 + 3  # the poisoned step and the three resets; none after
        with trio.fail_after(10):
            with pytest.raises(GenerationError, match="the device failed.*this server is stopping"):
                await rt.submit(rt.request(rt.encode("hello"), sampling=SamplingParams(max_tokens=3))).tokens()
        await trio.sleep(0.5)
        assert rt.engine.stats.failed_steps == failed  # no step is tried any more


def test_health_says_the_device_failed(tiny_model_dir, monkeypatch):
    device_fault.install_with(monkeypatch)
    with ServerThread(config_for(tiny_model_dir)) as server, httpx.Client(timeout=30) as client:
        root = server.base_url.removesuffix("/v1")
        assert client.get(f"{root}/health").json()["status"] == "ok"
        r = client.post(f"{server.base_url}/completions",
                        json={"model": "tiny", "prompt": [5, 6, device_fault.POISON], "max_tokens": 4})
        assert r.status_code == 500 and "illegal memory access" in r.json()["error"]["message"]
        deadline = time.monotonic() + 60  # three failed resets, however loaded the machine
        while (health := client.get(f"{root}/health")).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health.status_code == 503
        assert health.json()["status"] == "failed" and "illegal memory access" in health.json()["error"]


def test_mlxd_serve_stops_flushes_and_exits_1_when_its_device_is_lost(tiny_model_dir, tmp_path):
    with ServeProcess("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(tmp_path / "ssd"),
                      log_path=tmp_path / "serve.log", launcher=LAUNCHER) as proc:
        with proc.client() as client:
            ok = client.post(f"{proc.url}/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 3})
            assert ok.status_code == 200
            r = client.post(f"{proc.url}/v1/completions",
                            json={"model": "tiny", "prompt": [5, 6, device_fault.POISON], "max_tokens": 4})
            assert r.status_code == 500
        code = proc.wait(timeout=60)
        log = proc.log()
        assert code == 1, proc.post_mortem(code)
        assert '"event": "engine.device_lost"' in log and '"event": "serve.device_lost"' in log
        assert '"event": "serve.flushed"' in log  # the SSD tier flushed on the way out, as on SIGTERM
        assert "mlxd serve: the device failed: RuntimeError: cudaStreamSynchronize" in log
