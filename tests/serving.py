"""Test helper: a real mlxd HTTP server on loopback, run in a background thread."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import pytest
import trio

from mlxd.http.app import serve_http
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.messages import GenerationRequest, SamplingParams, TokenGenerated
from mlxd.runtime.supervisor import Runtime, open_runtime

T = TypeVar("T")


def served_with_patch(patch: Any, monkeypatch: pytest.MonkeyPatch, serve: Callable[[], Awaitable[T]], on: bool) -> T:
    """`serve()` under trio with one of mlxd's mlx-lm patches (model/batch_*.py: `ENV`, installed by the engine's
    load unless the environment turns it off, `uninstall`) on or off; it is uninstalled first, so the load decides."""
    patch.uninstall()
    monkeypatch.setenv(patch.ENV, "1" if on else "0")
    out = trio.run(serve)
    assert bool(patch._ORIGINAL) == on
    return out


class ServerThread:
    """`with ServerThread(config) as server:` gives `server.base_url` of a live server."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.base_url = ""
        self.runtime: Runtime | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # surfaced to the test thread
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with open_runtime(self.config) as rt, trio.open_nursery() as nursery:
            self.runtime = rt
            binds = await nursery.start(
                lambda task_status: serve_http(
                    rt, host="127.0.0.1", port=0, shutdown_trigger=self._stop.wait, task_status=task_status
                )
            )
            self.base_url = binds[0].replace("http://", "http://") + "/v1"
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def call(self, fn: Any, *args: Any) -> Any:
        """Run an async function on the server's trio loop (e.g. runtime.stats)."""
        assert self._token is not None
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(timeout=120)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout=60)


def config_for(model_dir: Any, **overrides: Any) -> RuntimeConfig:
    # The startup device probe is off: it measures this (shared, noisy) machine afresh each start,
    # which can tip a close restore-or-recompute call; tests of the probe turn it on.
    base = RuntimeConfig(
        model=str(model_dir), model_name="tiny", snapshot_min_tokens=16, max_context=4096, device_probe="off"
    )
    return attrs.evolve(base, **overrides)


def rows_ending_apart(model_dir: Any, max_tokens: list[int], spread: int) -> Callable[[], Awaitable[list[list[int]]]]:
    """A `serve` for `served_with_patch`: one greedy row per `max_tokens`, all submitted at once to a runtime whose
    batch holds them all, prompts `spread` repeats longer each (left padding in the batch); each row's tokens."""

    async def rows() -> list[list[int]]:
        async with open_runtime(config_for(model_dir, max_batch=len(max_tokens))) as rt:
            results: list[list[int]] = [[] for _ in max_tokens]

            async def one(i: int) -> None:
                prompt = rt.encode(f"row {i} " + "words and more words " * (3 + spread * i))
                sampling = SamplingParams(max_tokens=max_tokens[i], temperature=0.0)
                async with rt.submit(rt.request(prompt, sampling=sampling)) as s:
                    results[i] = list(await s.tokens())

            async with trio.open_nursery() as nursery:
                for i in range(len(max_tokens)):
                    nursery.start_soon(one, i)
            return results

    return rows


def mount_tmpfs(where: Path, options: str) -> None:
    """A real small filesystem for storage-failure tests (root only; skips otherwise)."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")



def umount(where: Path) -> None:
    """Undo `mount_tmpfs` (quietly: a test's own failure is the one to report)."""
    subprocess.run(["umount", str(where)], capture_output=True, timeout=30)

async def drop_after(rt: Runtime, request: GenerationRequest, n: int) -> list[int]:
    """The first `n` tokens of `request`; then the client goes away (its generation checkpoint stays)."""
    seen: list[int] = []
    async with rt.submit(request) as stream:
        async for event in stream:
            if isinstance(event, TokenGenerated):
                seen.append(event.token)
                if len(seen) == n:
                    break
    return seen


async def checkpoints_settled(rt: Runtime, timeout_s: float = 30.0) -> None:
    """Until the generation checkpointer has written and released every checkpoint (resumable then)."""
    assert rt.cold is not None and rt.cold.checkpointer is not None
    ckpt = rt.cold.checkpointer
    with trio.fail_after(timeout_s):
        while ckpt.snapshot_stats()["pending"] or ckpt.snapshot_stats()["owned"]:  # noqa: ASYNC110
            await trio.sleep(0.02)


async def greedy_turns(rt: Runtime, first: str, follow_ups: list[str], max_tokens: int) -> list[list[int]]:
    """A conversation's greedy turns through the chat path: `first`, then each of `follow_ups` after the
    reply before it (remembered, so each next turn's prefix is the cached one)."""
    from mlxd.runtime.kernel.messages import SamplingParams

    out: list[list[int]] = []
    messages = [{"role": "user", "content": first}]
    for follow_up in [*follow_ups, None]:
        ids, _ = await rt.render_chat_cut(messages)
        async with rt.submit(rt.request(ids, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))) as s:
            tokens = list(await s.tokens())
        out.append(tokens)
        text = rt.tokenizer.decode(tokens)
        rt.remember_reply(text, tokens)
        if follow_up is not None:
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
    return out
