"""How an embedded runtime ends: the caller's exception comes out as itself, and
cancellation flushes the SSD tier (real processes restarted on one directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import trio

from mlxd import RuntimeConfig, SamplingParams, open_runtime


class AppError(Exception):
    """An embedder's own error."""


def config(model_dir, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=str(model_dir), model_name="tiny", snapshot_min_tokens=16, device_probe="off", **kw)


async def test_a_callers_exception_is_not_wrapped(tiny_model_dir):
    with pytest.raises(AppError, match="mine") as info:
        async with open_runtime(config(tiny_model_dir)):
            raise AppError("mine")
    assert type(info.value) is AppError


async def test_a_callers_exception_group_comes_out_as_the_same_group(tiny_model_dir):
    mine = ExceptionGroup("mine", [AppError("a"), AppError("b")])
    with pytest.raises(ExceptionGroup) as info:
        async with open_runtime(config(tiny_model_dir)):
            raise mine
    assert info.value is mine


async def test_except_catches_the_callers_exception_after_requests(tiny_model_dir):
    caught = None
    try:
        async with open_runtime(config(tiny_model_dir)) as rt:
            async with rt.submit(rt.request(rt.encode("hello"), sampling=SamplingParams(max_tokens=2))) as stream:
                await stream.tokens()
            raise AppError("after a request")
    except AppError as exc:
        caught = exc
    assert caught is not None and str(caught) == "after a request"


async def test_cancelling_the_scope_cancels_the_caller_not_a_wrapped_error(tiny_model_dir):
    with trio.move_on_after(0) as scope:
        async with open_runtime(config(tiny_model_dir)):
            await trio.sleep_forever()
    assert scope.cancelled_caught


def test_only_the_callers_lone_exception_is_unwrapped():
    from mlxd.runtime.supervisor import _callers_own

    mine, other = AppError("mine"), KeyError("actor")
    assert _callers_own(BaseExceptionGroup("x", [mine]), mine) is mine
    assert _callers_own(BaseExceptionGroup("x", [mine, other]), mine) is None  # a real multi-error stays a group
    assert _callers_own(BaseExceptionGroup("x", [other]), mine) is None  # an actor's failure stays a group
    assert _callers_own(BaseExceptionGroup("x", [other]), None) is None
    # A cancel scope's split hands back a copy of the caller's group: matched by its leaves.
    group = ExceptionGroup("mine", [mine])
    assert _callers_own(BaseExceptionGroup("x", [group.derive([mine])]), group) is group
    assert _callers_own(BaseExceptionGroup("x", [group.derive([AppError("another")])]), group) is None


CHILD = textwrap.dedent('''
    import json, sys
    import trio
    import mlxd

    model, ssd, phase = sys.argv[1:4]
    PROMPTS = [[(7 * i + 31 * c) % 200 + 10 for i in range(96)] for c in range(3)]


    async def main():
        config = mlxd.RuntimeConfig(model=model, model_name="tiny", ssd_cache_dir=ssd, snapshot_min_tokens=16,
                                    device_probe="off")
        async with trio.open_nursery() as nursery:
            rt = await nursery.start(mlxd.serve_runtime, config)
            for c, prompt in enumerate(PROMPTS):
                request = rt.request(prompt, sampling=mlxd.SamplingParams(max_tokens=4))
                async with rt.submit(request) as stream:
                    await stream.tokens()
                accepted = stream.accepted
                print("RESULT", json.dumps({"conversation": c, "prompt": len(prompt),
                                            "cached": accepted.cached_tokens, "tier": accepted.cache_tier}),
                      flush=True)
            nursery.cancel_scope.cancel()  # no stop_admission, drain or flush: just cancel
        print("RESULT", json.dumps({"stopped": phase}), flush=True)


    trio.run(main)
''')


def run_child(tmp_path, model_dir, ssd, phase: str) -> list[dict]:
    script = tmp_path / "embed_child.py"
    script.write_text(CHILD)
    proc = subprocess.run([sys.executable, str(script), str(model_dir), str(ssd), phase], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line.removeprefix("RESULT ")) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def test_cancelling_the_runtime_flushes_every_conversation(tmp_path, tiny_model_dir):
    ssd = tmp_path / "ssd"
    first = run_child(tmp_path, tiny_model_dir, ssd, "first")
    assert [r.get("tier") for r in first[:3]] == ["none"] * 3 and first[-1] == {"stopped": "first"}
    second = run_child(tmp_path, tiny_model_dir, ssd, "second")
    restored = second[:3]
    assert [r["tier"] for r in restored] == ["ssd"] * 3, restored
    assert all(r["cached"] >= r["prompt"] - 1 for r in restored), restored
