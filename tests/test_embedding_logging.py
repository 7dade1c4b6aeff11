"""An embedded runtime prints nothing of its own: its log lines go where the program's logging
configuration sends them, and nowhere (least of all stdout) when there is none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent('''
    import logging, sys
    import trio
    import mlxd

    model, ssd, setup = sys.argv[1:4]
    if setup == "stdlib":
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    elif setup == "mlxd":
        from mlxd.runtime.logging import configure_logging
        configure_logging("json")


    async def main():
        print("program: start")
        config = mlxd.RuntimeConfig(model=model, model_name="tiny", snapshot_min_tokens=16, device_probe="off",
                                    ssd_cache_dir=ssd or None)
        async with mlxd.open_runtime(config) as rt:
            request = rt.request(rt.encode("hello there, cache"), sampling=mlxd.SamplingParams(max_tokens=3))
            async with rt.submit(request) as stream:
                tokens = await stream.tokens()
            await rt.flush()
        print(f"program: {len(tokens)} tokens")
        print("program: end")


    trio.run(main)
''')
PROGRAM_OUTPUT = "program: start\nprogram: 3 tokens\nprogram: end\n"


def run(tmp_path, model_dir, setup: str, *, ssd: bool = False) -> subprocess.CompletedProcess:
    script = tmp_path / "embed_logging.py"
    script.write_text(CHILD)
    ssd_dir = str(tmp_path / "ssd") if ssd else ""
    proc = subprocess.run([sys.executable, str(script), str(model_dir), ssd_dir, setup], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_unconfigured_logging_prints_nothing(tmp_path, tiny_model_dir):
    proc = run(tmp_path, tiny_model_dir, "none")
    assert proc.stdout == PROGRAM_OUTPUT
    assert "engine.ready" not in proc.stderr


def test_unconfigured_logging_prints_nothing_with_an_ssd_tier(tmp_path, tiny_model_dir):
    proc = run(tmp_path, tiny_model_dir, "none", ssd=True)
    assert proc.stdout == PROGRAM_OUTPUT


def test_stdlib_logging_receives_mlxd_lines(tmp_path, tiny_model_dir):
    """A program that configures only the standard library's logging gets mlxd's lines there."""
    proc = run(tmp_path, tiny_model_dir, "stdlib")
    assert proc.stdout == PROGRAM_OUTPUT
    ready = [line for line in proc.stderr.splitlines() if line.startswith("mlxd.") and " engine.ready " in line]
    assert ready and "INFO" in ready[0] and "model=tiny" in ready[0], proc.stderr[-2000:]


def test_configure_logging_gives_json_lines_on_stderr(tmp_path, tiny_model_dir):
    proc = run(tmp_path, tiny_model_dir, "mlxd")
    assert proc.stdout == PROGRAM_OUTPUT
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert any(e["event"] == "engine.ready" and e["level"] == "info" for e in events), proc.stderr[-2000:]
