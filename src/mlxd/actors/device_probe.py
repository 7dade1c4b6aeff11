"""The startup probe: measure this device before the server listens (engine thread).

Runs real prefills through the engine's own `BatchGenerator` (the same
chunking and caches serving uses) at growing lengths until a time budget is
spent, a few decode steps, and, with an SSD tier, a cold restore of real
snapshot files through the path serving restores by (`RestorePath`): the
store's own layout (whole files or blocks), readers and CRC checks
(`SsdStore.load`) on a reader thread as the prefetcher's, read into MLX arrays
where serving lands them there (`restore_landing`, the engine's own `landing`,
allocated on the engine's thread), adopted as the engine adopts them
(`kinds.adopt`), at two sizes (a fixed cost and a per-byte cost; the larger
near a served record's size, `RESTORE_MAX_BYTES`); each file is then restored again from the page
cache, as serving meets a file written or read recently (a restarted server's
newest files: the advisor prices the bytes `mincore` finds resident at that
speed); with a host tier on separate host memory, its two bulk copies too. `kv.device_costs` fits a cost model to the numbers; the restore
advisor starts from it and keeps refining online.

Optionally it also picks the prefill chunk size: the same prefill timed at
each candidate chunk size, the fastest kept (GPU only by default: on a CPU
the chunk size barely moves throughput and each trial costs seconds).
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from mlxd.kv.device_costs import DeviceProbe
from mlxd.runtime import device_memory
from mlxd.runtime.logging import get_logger

if TYPE_CHECKING:
    from mlxd.kv.file_format import FileHeader, Landing
    from mlxd.runtime.config import RuntimeConfig

log = get_logger("mlxd.probe")

FIRST_TOKENS = 64
GROWTH = 4
MAX_TOKENS = 16384
DECODE_STEPS = 8
STEP_CANDIDATES = (1024, 2048, 4096, 8192, 16384)
# The large restore point: the longest probe whose KV fits this (a real 16k-token record of a 1.7B model,
# 1.88 GB, does): a served restore is timed at a record's size, not a quarter of it. It is timed only when
# the medium point (the longest within RESTORE_MEDIUM_BYTES), scaled to its size, predicts its write and
# read within RESTORE_BUDGET_S (a slow disk keeps startup bounded).
RESTORE_MAX_BYTES = 2 << 30
RESTORE_MEDIUM_BYTES = 512 << 20
RESTORE_BUDGET_S = 2.0  # H200 15:50: the 1.88 GB point read as the 470 MB one did per byte, and took the probe 8 -> 15 s


@attrs.frozen(kw_only=True)
class RestorePath:
    """How serving restores a cold prefix; the probe times this same path."""

    directory: Path  # the SSD cache directory (the probe's files go in a temporary directory under it)
    land: Callable[[FileHeader], Landing] | None = None  # MLX arrays to read into; None = a host buffer
    verify: bool = True  # every tensor's CRC-32 checked (--ssd-cache-verify)
    layout: str = "whole"  # or "blocks"
    block_tokens: int = 256
    host_tier: bool = False  # --host-cache-gb on separate host memory: time its demotion and promotion

    @property
    def landing(self) -> str:
        return "mlx" if self.land is not None else "host"


def lands_in_mlx(config: RuntimeConfig) -> bool:
    """Does serving read restored bytes straight into MLX arrays (restore_landing, "auto" resolved)?"""
    return config.restore_landing == "mlx" or (config.restore_landing == "auto" and not device_memory.is_metal())


def probe_device(
    generator: Any,
    *,
    vocab_size: int,
    max_context: int,
    kv_bytes_per_token: int,
    budget_s: float,
    restore: RestorePath | None,
    tune_step: bool,
) -> DeviceProbe:
    """Measure prefill, decode and (with `restore`) restore on this thread's device."""
    import mlx.core as mx

    t0 = time.perf_counter()
    rng = _Tokens(vocab_size)
    limit = max(16, min(MAX_TOKENS, max_context - DECODE_STEPS - 2))
    # Warm-up at the first length: kernels compiled and buffers allocated for
    # these shapes, so the first measured point is not a start-up outlier.
    _run(generator, rng.take(min(FIRST_TOKENS, limit)), decode=2)
    budget_start = time.perf_counter()  # one-time start-up (kernel JIT on CUDA) is not the budget's
    prefill: list[tuple[int, float]] = []
    decode: list[float] = []
    caches: list[tuple[int, list[Any]]] = []
    n = min(FIRST_TOKENS, limit)
    while True:
        # Twice per length, the faster kept: a new shape's first run can pay one-time
        # costs (on CUDA, attention plans and kernels built per shape).
        first, steps, first_cache = _run(generator, rng.take(n), decode=DECODE_STEPS)
        del first_cache  # the second run's is kept
        seconds, more, cache = _run(generator, rng.take(n), decode=DECODE_STEPS)
        seconds = min(first, seconds)
        prefill.append((n, seconds))
        decode.extend(steps + more)
        caches.append((n, cache))
        if n >= limit:
            break
        # Three lengths at least (three coefficients to fit); beyond that, grow
        # while the next probe is predicted to fit in what is left of the budget.
        left = budget_s - (time.perf_counter() - budget_start)
        grow = GROWTH
        while grow > 2 and 2 * seconds * grow**1.5 > left:
            grow //= 2
        if len(prefill) >= 3 and 2 * seconds * grow**1.5 > left:
            break
        n = min(n * grow, limit)
    step = generator.prefill_step_size
    trials: list[tuple[int, float]] = []
    if tune_step:
        step, trials = _tune_step(generator, rng, prefill[-1][0])
    restored: list[tuple[int, float]] = []
    host: list[tuple[int, float]] = []
    parts: list[tuple[int, float, float, float]] = []
    landed = 0
    if restore is not None:
        # The prefills' freed buffers go back to the device first: MLX reuses cached buffers by size, and
        # on CUDA (managed memory) a reused buffer's pages are where its last user left them (the device),
        # so a landing carved from them would be faulted over to the host page by page as the reader fills
        # it, where a restarted server's first restore lands in fresh memory (docs/benchmarks.md).
        mx.clear_cache()
        # The first restore pays one-time costs (allocations, kernels): a throwaway warm-up.
        # Sizes to fit a fixed cost and a per-byte cost: the smallest probe, a medium one, and the
        # longest whose KV fits RESTORE_MAX_BYTES (near a served record's size) where the medium one
        # predicts it within RESTORE_BUDGET_S.
        timed = _probe_restore(restore, _restore_points(caches, kv_bytes_per_token), budget_s=RESTORE_BUDGET_S)
        restored, host = [t.restore for t in timed[1:]], [t.host for t in timed[1:] if t.host is not None]
        warm = [t.warm for t in timed[1:] if t.warm is not None]
        parts = [t.parts for t in timed[1:]]
        landed = sum(t.into_mlx for t in timed[1:])
    decode.sort()
    # Serving starts as a server without the probe would: none of the probe's buffers cached. Its KV
    # caches (up to a 16k-token record's 1.9 GB on the 1.7B shape) go first: cleared while still held,
    # they went to MLX's cache when this function returned, where serving's first allocations could be
    # carved from them (on CUDA: managed buffers whose pages the prefills left on the device).
    del cache
    caches.clear()
    release_probe_memory()
    probe = DeviceProbe(
        device=str(mx.default_device()),
        prefill=tuple(prefill),
        decode_s_per_token=decode[len(decode) // 2] if decode else 0.0,
        restore=tuple(restored),
        restore_warm=tuple(warm) if restored else (),
        restore_landing=restore.landing if restore is not None else "",
        restore_layout=restore.layout if restore is not None else "",
        restores_into_mlx=landed,
        restore_parts=tuple(parts),
        host=tuple(host),
        kv_bytes_per_token=kv_bytes_per_token,
        prefill_step_size=step,
        step_trials=tuple(trials),
        seconds=time.perf_counter() - t0,
    )
    return probe


def warm_up(generator: Any, prefill_apart: Callable[[list[int]], Any], *, vocab_size: int, tokens: int,
            batch: bool) -> float:
    """Run `tokens` of prompt, untimed, through `prefill_apart` (the engine's prefill of a prompt on its own
    caches, in the serving chunk size: what an overlapped restore's head runs, and a prompt prefilled apart)
    and, with `batch`, through the serving generator too, with two decode steps; give their buffers back.
    Seconds spent. On CUDA each (queries, keys) shape, and each cache layout's strides, builds its kernels
    and attention plans on first use; the probe's prefills (in the generator's batch) build the batch's, a
    process that reused the saved probe (kv/probe_file.py) none: `batch` is for that process."""
    t0 = time.perf_counter()
    rng = _Tokens(vocab_size)
    if batch:
        _run(generator, rng.take(tokens), decode=2)
    prefill_apart(rng.take(tokens + 1))  # (prefilled up to its last token: `tokens` in whole chunks)
    release_probe_memory()
    return time.perf_counter() - t0


def _restore_points(caches: list[tuple[int, list[Any]]], kv_bytes_per_token: int) -> list[tuple[int, list[Any]]]:
    """The probe's caches to restore: the smallest twice (a warm-up), a medium one, the largest allowed."""
    fits = [c for c in caches if c[0] * kv_bytes_per_token <= RESTORE_MAX_BYTES] or caches[:1]
    medium = [c for c in fits if c[0] * kv_bytes_per_token <= RESTORE_MEDIUM_BYTES] or fits[:1]
    larger: list[tuple[int, list[Any]]] = []
    for c in (medium[-1], fits[-1]):
        if c[0] > caches[0][0] and all(c[0] != x[0] for x in larger):
            larger.append(c)
    return [caches[0], caches[0], *larger]


def release_probe_memory() -> None:
    """Give the probe's freed buffers back to the device (MLX keeps freed buffers cached for reuse by size):
    serving's first allocations come from fresh memory, as in a server that never ran the probe."""
    import gc

    import mlx.core as mx

    gc.collect()  # a cache object held only by a reference cycle (mlx-lm's batch rows) goes now, not later
    mx.clear_cache()


class _Tokens:
    """Random prompt tokens (fresh each call, so no probe reuses another's cache)."""

    def __init__(self, vocab_size: int) -> None:
        import numpy as np

        self._rng = np.random.default_rng(0)
        self._vocab = max(2, vocab_size)

    def take(self, n: int) -> list[int]:
        return [int(x) for x in self._rng.integers(1, self._vocab, size=n)]


def _run(generator: Any, prompt: list[int], *, decode: int) -> tuple[float, list[float], list[Any]]:
    """Prefill `prompt`, decode `decode` tokens: (prefill seconds, per-step decode seconds, cache)."""
    t0 = time.perf_counter()
    (uid,) = generator.insert([prompt], max_tokens=[decode])
    prefill: float | None = None
    steps: list[float] = []
    cache: list[Any] = []
    last = t0
    while True:
        _, gen = generator.next()
        now = time.perf_counter()
        mine = [r for r in gen if r.uid == uid]
        if mine:
            if prefill is None:
                prefill = now - t0  # through the first token, as a request sees it
            else:
                steps.append(now - last)
            last = now
            if mine[0].finish_reason is not None:
                cache = list(mine[0].prompt_cache or [])
                break
    assert prefill is not None
    return prefill, steps, cache


def _tune_step(generator: Any, rng: _Tokens, tokens: int) -> tuple[int, list[tuple[int, float]]]:
    """Time the same-length prefill at each candidate chunk size; keep the fastest."""
    original = generator.prefill_step_size
    trials: list[tuple[int, float]] = []
    for step in sorted({*(s for s in STEP_CANDIDATES if s <= tokens), original}):
        generator.prefill_step_size = step
        seconds = min(_run(generator, rng.take(tokens), decode=1)[0] for _ in range(2))
        trials.append((step, seconds))
    best = min(trials, key=lambda t: t[1])[0]
    generator.prefill_step_size = best
    if best != original:
        log.info("probe.prefill_step_chosen", step=best, was=original, trials=trials)
    return best, trials


@attrs.frozen
class _Timed:
    restore: tuple[int, float]  # (KV bytes, seconds to read cold and adopt)
    into_mlx: bool  # read straight into MLX arrays
    host: tuple[int, float] | None  # (KV bytes, seconds of the host tier's demotion + promotion)
    warm: tuple[int, float] | None = None  # (KV bytes, seconds to read and adopt it again, page cache warm)
    parts: tuple[int, float, float, float] = (0, 0.0, 0.0, 0.0)  # the cold one's (bytes, landing, read, adopt) s


def _probe_restore(path: RestorePath, caches: list[tuple[int, list[Any]]], *, budget_s: float = float("inf")
                   ) -> list[_Timed]:
    """Write each cache through a real store of serving's layout, drop its files from the page
    cache, and restore it cold as serving does (read, landing, verify, adopt); the second (the first
    is a warm-up) and the last timed again from the page cache. A point after the third is timed only
    where the one before it, scaled to its size, predicts its write and cold read within `budget_s`."""
    import mlx.core as mx

    from mlxd.kv import file_format, kinds
    from mlxd.kv.ssd_store import Failed, SsdStore, StoreIdentity, compute_fingerprint

    path.directory.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=".device-probe-", dir=path.directory))
    identity = StoreIdentity("probe", compute_fingerprint({"probe": "restore"}), "probe")
    store = SsdStore(workdir, identity, layout=path.layout, block_tokens=path.block_tokens)
    out: list[_Timed] = []
    try:
        for i, (n, cache) in enumerate(caches):
            if not cache:
                continue
            t0 = time.perf_counter()
            stored = store.write(kinds.plan_snapshot(cache, meta=identity.meta(range(n), "")))
            if isinstance(stored, Failed):
                raise file_format.StorageError(stored.error)
            record = stored.record
            assert record.path is not None
            for f in (record.path, *store.blocks.block_paths(record)):
                _drop_page_cache(f)
            write_s = time.perf_counter() - t0
            loaded, adopted, seconds, parts = _restore_once(store, record, path)
            host = _probe_host_tier(adopted, loaded.nbytes) if path.host_tier else None
            nbytes, into_mlx = loaded.nbytes, loaded.landed is not None
            del adopted, loaded
            mx.clear_cache()  # the next landing in fresh memory, as a restarted server's first restore finds it
            following = caches[i + 1] if i + 1 < len(caches) else None
            if following is not None and i >= 2 and nbytes > 0:
                predicted = (write_s + seconds) * following[0] / n
                if predicted > budget_s:
                    log.info("probe.restore_point_skipped", tokens=following[0], predicted_s=round(predicted, 2),
                             budget_s=budget_s)
                    following = None
            warm = None
            if i == 1 or (i > 1 and following is None):  # its pages are in the page cache now: the same again
                again, _, warm_s, _ = _restore_once(store, record, path)
                warm = (again.nbytes, warm_s)
                del again
                mx.clear_cache()
            out.append(_Timed((nbytes, seconds), into_mlx, host, warm, (nbytes, *parts)))
            if following is None:
                break
    except Exception as exc:  # a storage or landing failure (no memory for it): serving starts without these points
        log.warning("probe.restore_failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        store.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def _restore_once(
    store: Any, record: Any, path: RestorePath, *, meanwhile: Callable[[], object] | None = None
) -> tuple[Any, list[Any], float, tuple[float, float, float]]:
    """One restore as serving runs and times it: the store's read (its layout, readers, checks, the
    engine's landing) on a worker thread, as the prefetcher reads (`PrefetcherActor._read`: the landing
    is allocated on the engine's thread, here the calling one, while the reader waits), its own read
    time, plus the engine's adoption on this thread (`EngineCore._restore`), which starts the pages'
    move to the device without waiting for it; (loaded, caches, seconds, (landing, read, adopt) s).

    (It once evaluated the caches' state too, which serving does not: docs/benchmarks.md.) `meanwhile`: as
    `load_as_prefetched`'s."""
    from mlxd.kv import file_format, kinds

    loaded, landing_s = load_as_prefetched(store, record, verify=path.verify, land=path.land, meanwhile=meanwhile)
    if loaded is None:
        raise file_format.StorageError("the probe's own snapshot did not read back")
    t0 = time.perf_counter()
    adopted = kinds.adopt(loaded, landed=device_memory.to_device)
    adopt_s = time.perf_counter() - t0
    return loaded, adopted, loaded.seconds + adopt_s, (landing_s, loaded.seconds - landing_s, adopt_s)


def load_as_prefetched(
    store: Any, record: Any, *, verify: bool, land: Callable[[FileHeader], Landing] | None,
    meanwhile: Callable[[], object] | None = None,
) -> tuple[Any, float]:
    """`store.load` on a worker thread with `land` run on this thread (the engine's), as the prefetcher
    hands its landing to the engine; (loaded or None, seconds this thread spent on the landing).
    `meanwhile`: called over and over on this thread once the landing is handed, while the reader fills it
    (a benchmark's engine busy with other requests' forward passes beside the read)."""
    asks: queue.Queue[tuple[FileHeader, queue.Queue[Any]] | None] = queue.Queue()
    result: dict[str, Any] = {}

    def landed_here(header: FileHeader) -> Landing:
        reply: queue.Queue[Any] = queue.Queue(maxsize=1)
        asks.put((header, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def read() -> None:
        try:
            result["loaded"] = store.load(record, verify=verify, land=landed_here if land is not None else None)
        except BaseException as exc:  # raised again on the calling thread
            result["error"] = exc
        finally:
            asks.put(None)

    reader = threading.Thread(target=read, name="mlxd-probe-read", daemon=True)
    reader.start()
    landing_s, handed = 0.0, False
    while True:
        while meanwhile is not None and handed and asks.empty() and reader.is_alive():
            meanwhile()
        if (ask := asks.get()) is None:
            break
        header, reply = ask
        t0 = time.perf_counter()
        try:
            assert land is not None
            reply.put((True, land(header)))
            handed = True
        except Exception as exc:  # the reader raises it, as serving's reader meets a failed landing
            reply.put((False, exc))
        landing_s += time.perf_counter() - t0
    reader.join()
    if "error" in result:
        raise result["error"]
    return result.get("loaded"), landing_s


def _probe_host_tier(caches: list[Any], nbytes: int) -> tuple[int, float]:
    """The host tier's two bulk copies of a restored entry: demoted to host memory, promoted back
    (what a returning conversation waits for), as the cache owner moves them."""
    from mlxd.runtime import host_memory

    host_memory.move_pages(caches, to_host=True)
    host_memory.wait_moves()
    t0 = time.perf_counter()
    host_memory.move_pages(caches, to_host=False)
    host_memory.wait_moves()
    return nbytes, time.perf_counter() - t0


def _drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's (clean, fsynced) pages, so the read is cold."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
