"""The page-cache warmer: after a start, the SSD tier's newest files read into the page cache.

One task, started once the scan has indexed the directory; it reads on a worker thread
(`SsdStore.warm_page_cache`, kv/page_cache_warmup.py), piece by piece, stepping aside while the
prefetcher or a restore reads, and ends when it has read its budget (the RAM tier's size) or the
runtime stops.
"""

from __future__ import annotations

import threading

import trio

from mlxd.kv.ssd_store import SsdStore
from mlxd.kv.tiers import SsdRecord
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.ssd")


class PageCacheWarmerActor:
    def __init__(self, store: SsdStore, records: list[SsdRecord], budget_bytes: int) -> None:
        self._store = store
        self._records = records
        self._budget = budget_bytes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        stop = threading.Event()
        task_status.started()
        try:
            warmed = await trio.to_thread.run_sync(
                self._store.warm_page_cache, self._records, self._budget, stop, abandon_on_cancel=True
            )
        finally:
            stop.set()  # an abandoned thread ends after the piece it is reading
        log.info("ssd.page_cache_warmed", bytes=warmed.chosen_bytes, read_bytes=warmed.read_bytes,
                 files=warmed.files, skipped_resident=warmed.skipped_resident, paused_s=warmed.paused_s,
                 seconds=warmed.seconds)
