"""The prefetcher: reads cold-tier files on worker threads ahead of an engine slot.

When a request arrives, the cache owner looks up the SSD record it will
likely restore and sends it here (`PrefetchRecord`); the file read starts at
once, so it overlaps the wait for a batch slot. When the scheduler later
restores, `FetchSnapshot` returns the bytes already read (or waits for the
read in flight). A file that cannot be read back is reported to the cache
owner (`RecordLost`). Reads never touch MLX; the engine adopts the bytes on
its own thread. With `land` (the engine's `landing`; `--restore-landing`), the engine
first allocates MLX arrays for the file's tensors on its thread and the read
fills them directly, so adopting copies nothing. An overlapped split's tail
(`FetchTail`) lands the same way: its memory is allocated before the engine
starts recomputing the head (`TailSlot.place`: the scheduler starts the row
only once the read has its memory; the engine thread could not allocate while
it recomputes), and the read lands in the request's `TailSlot`, which the engine
looks at between the head's chunks (read the host way, its copy into MLX
after the head cost more than the overlap saved: docs/benchmarks.md). This
actor holds no other actor's state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from mlxd.kv.file_format import FileHeader, Landing, LoadedSnapshot
from mlxd.kv.ssd_store import SsdStore
from mlxd.kv.tiers import SsdRecord
from mlxd.runtime.kernel.messages import (
    CacheOwnerMessage,
    FetchSnapshot,
    FetchTail,
    PrefetcherMessage,
    PrefetchRecord,
    PrefetchSnapshot,
    PrefetchStats,
    RecordLost,
)
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.prefetcher")


class _LandingFailed(Exception):
    """The engine could not provide MLX memory for a read (the file itself is not at fault)."""


class _Read:
    def __init__(self, upto: int = 0, start: int = 0) -> None:
        self.done = trio.Event()
        self.loaded: LoadedSnapshot | None = None
        self.placed = trio.Event()  # its memory allocated (a landing), or it reads the host way, or it ended
        self.upto = upto  # > 0: the record's first `upto` tokens only
        self.start = start  # > 0: its tokens from `start` on only (an overlapped split's tail)

    def serves(self, upto: int, start: int) -> bool:
        """Can this read serve a restore of the record's part [start, upto)? (0: its first / last token)"""
        return self.start == start and (self.upto == upto or (self.upto == 0 and not start))


class PrefetcherActor:
    def __init__(
        self,
        store: SsdStore,
        *,
        inbox: trio.MemoryReceiveChannel[PrefetcherMessage],
        cache: trio.MemorySendChannel[CacheOwnerMessage],
        verify: bool,
        max_ready: int = 4,
        land: Callable[[FileHeader], Awaitable[Landing]] | None = None,
    ) -> None:
        self._store = store
        self._land = land
        self._inbox = inbox
        self._cache = cache
        self._verify = verify
        self._max_ready = max_ready
        self._reads: OrderedDict[Path | None, _Read] = OrderedDict()
        self._threads = trio.CapacityLimiter(2)
        self._stats = PrefetchSnapshot()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            async with self._inbox, self._cache:
                async for msg in self._inbox:
                    try:
                        self._handle(nursery, msg)
                    except Exception as exc:  # one bad message fails its own reply, not the runtime
                        log.exception("prefetch.handler_failed", message=type(msg).__name__)
                        if isinstance(msg, FetchSnapshot | PrefetchStats):
                            msg.reply.fail(exc)
                        elif isinstance(msg, FetchTail):
                            msg.slot.place()
                            msg.slot.land(None)

    def _handle(self, nursery: trio.Nursery, msg: PrefetcherMessage) -> None:
        if isinstance(msg, PrefetchRecord):
            if msg.record.path not in self._reads:
                self._count(prefetches=1)
                self._start(nursery, msg.record, msg.upto, msg.start)
        elif isinstance(msg, FetchSnapshot | FetchTail):
            nursery.start_soon(self._fetch, nursery, msg)
        elif isinstance(msg, PrefetchStats):
            msg.reply.send(self._stats)

    def _count(self, **delta: int) -> None:
        s = self._stats
        self._stats = attrs.evolve(s, **{k: getattr(s, k) + v for k, v in delta.items()})

    def _start(self, nursery: trio.Nursery, record: SsdRecord, upto: int = 0, start: int = 0) -> _Read:
        read = _Read(upto, start)
        self._reads[record.path] = read
        while len(self._reads) > self._max_ready:
            self._reads.popitem(last=False)  # drop the oldest unclaimed read (its bytes)
        nursery.start_soon(self._read, record, read)
        return read

    async def _read(self, record: SsdRecord, read: _Read) -> None:
        upto, start = read.upto, read.start
        allocate = self._land
        if allocate is None:
            read.placed.set()

        async def allocated(header: FileHeader) -> Landing:
            assert allocate is not None
            try:
                return await allocate(header)
            finally:
                read.placed.set()

        def land(header: FileHeader) -> Landing:
            try:
                return trio.from_thread.run(allocated, header)
            except (Exception, trio.Cancelled) as exc:  # e.g. no memory for it, or shutting down
                raise _LandingFailed(repr(exc)) from exc

        def load() -> LoadedSnapshot | None:
            if allocate is not None:
                try:
                    return self._store.load(record, verify=self._verify, land=land, upto=upto, start=start)
                except _LandingFailed as exc:  # the file is fine: read it the host way instead
                    log.warning("prefetch.landing_failed", path=str(record.path), error=str(exc))
            return self._store.load(record, verify=self._verify, upto=upto, start=start)

        try:
            read.loaded = await trio.to_thread.run_sync(load, limiter=self._threads)
        except Exception as exc:  # a failed read is a miss
            log.warning("prefetch.read_failed", path=str(record.path), error=repr(exc))
            read.loaded = None
        finally:
            read.placed.set()
            read.done.set()
        if read.loaded is None:
            self._count(reads=1, read_failures=1)
            try:
                self._cache.send_nowait(RecordLost(record))
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the next read of it reports again
        else:
            self._count(reads=1, bytes_read=read.loaded.nbytes, reads_into_mlx=int(read.loaded.landed is not None))

    async def _fetch(self, nursery: trio.Nursery, msg: FetchSnapshot | FetchTail) -> None:
        start = msg.start if isinstance(msg, FetchTail) else 0
        read = self._reads.pop(msg.record.path, None)
        if read is not None and not read.serves(msg.upto, start):
            read = None  # read ahead to another part: read what this restore takes (a whole read serves a split)
        if read is not None:
            self._count(prefetch_hits=1)
        else:
            read = self._start(nursery, msg.record, msg.upto, start)  # a split reads only its leading blocks
            self._reads.pop(msg.record.path, None)
        if isinstance(msg, FetchTail):
            await read.placed.wait()
            msg.slot.place()
        await read.done.wait()
        if isinstance(msg, FetchTail):
            msg.slot.land(read.loaded)
        else:
            msg.reply.send(read.loaded)
