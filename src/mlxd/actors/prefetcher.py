"""The prefetcher: reads cold-tier files on worker threads ahead of an engine slot.

A request's arrival sends a hint; when the SSD holds a longer usable prefix
than RAM, the file read starts at once, so it overlaps the wait for a batch
slot. When the scheduler later decides to restore, `FetchSnapshot` returns the
bytes already read (or waits for the read in flight). Reads never touch MLX;
the engine adopts the bytes on its own thread.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import trio

from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.ssd_store import SsdStore
from mlxd.runtime.logging import get_logger
from mlxd.runtime.messages import FetchSnapshot, PrefetchHint

log = get_logger("mlxd.prefetcher")


class _Read:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.loaded: Any = None


class PrefetcherActor:
    def __init__(
        self,
        store: SsdStore,
        ram: PromptCache,
        *,
        inbox: trio.MemoryReceiveChannel[PrefetchHint | FetchSnapshot],
        verify: bool,
        max_ready: int = 4,
    ) -> None:
        self._store = store
        self._ram = ram  # read-only peeks (same trio thread as the cache owner)
        self._inbox = inbox
        self._verify = verify
        self._max_ready = max_ready
        self._reads: OrderedDict[Path, _Read] = OrderedDict()
        self._threads = trio.CapacityLimiter(2)
        self.stats = {"prefetches": 0, "prefetch_hits": 0, "reads": 0, "read_failures": 0, "bytes_read": 0}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            async with self._inbox:
                async for msg in self._inbox:
                    if isinstance(msg, PrefetchHint):
                        self._hint(nursery, msg)
                    else:
                        nursery.start_soon(self._fetch, nursery, msg)

    def _hint(self, nursery: trio.Nursery, msg: PrefetchHint) -> None:
        match = self._store.find(msg.tokens, msg.namespace)
        if match is None:
            return
        ram = self._ram.peek(msg.tokens, msg.namespace)
        if ram is not None and ram.usable >= match.usable:
            return
        if match.entry.path not in self._reads:
            self.stats["prefetches"] += 1
            self._start(nursery, match.entry)

    def _start(self, nursery: trio.Nursery, entry: Any) -> _Read:
        read = _Read()
        self._reads[entry.path] = read
        while len(self._reads) > self._max_ready:
            self._reads.popitem(last=False)  # drop the oldest unclaimed read (its bytes)
        nursery.start_soon(self._read, entry, read)
        return read

    async def _read(self, entry: Any, read: _Read) -> None:
        try:
            read.loaded = await trio.to_thread.run_sync(
                lambda: self._store.load(entry, verify=self._verify), limiter=self._threads
            )
        except Exception as exc:  # a failed read is a miss
            log.warning("prefetch.read_failed", path=str(entry.path), error=repr(exc))
            read.loaded = None
        self.stats["reads"] += 1
        if read.loaded is None:
            self.stats["read_failures"] += 1
        else:
            self.stats["bytes_read"] += read.loaded.nbytes
        read.done.set()

    async def _fetch(self, nursery: trio.Nursery, msg: FetchSnapshot) -> None:
        read = self._reads.pop(msg.entry.path, None)
        if read is not None:
            self.stats["prefetch_hits"] += 1
        else:
            read = self._start(nursery, msg.entry)
            self._reads.pop(msg.entry.path, None)
        await read.done.wait()
        msg.reply.send(read.loaded)
