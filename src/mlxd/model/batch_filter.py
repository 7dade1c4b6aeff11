"""Rows leave mlx-lm's batch without waiting for the forward in flight (`MLXD_BATCH_FILTER`).

mlx-lm's `BatchKVCache.filter` gathers the kept rows' left padding on the device and reads it back
(`tolist()`) to trim the padding no kept row needs. `GenerationBatch.next` filters right after it has
dispatched the next step's forward, so that read queues behind the forward on the generation stream:
the engine thread waits for the whole next forward before it can hand out the step's tokens, and the
host work of the following step no longer overlaps a forward. Whenever rows end while others go on
decoding, the others wait for it (mlx_lm.server too, when its rows end in different steps). Measured so
far it is neutral: mlx-lm's filter ÷ this one 0.997 [0.989-1.015] on an H100, 1.002 on the CPU
(docs/benchmarks.md, H100 2026-12-06 09:01; `bench_final_plan.py` arms `+mlxfilter`).

Here the padding is read as it stands (`kv.quantized_batch.kept_padding`): an evaluated array (the
masks of the forwards since the rows joined read it) is read without queuing anything, the kept rows'
values are picked on the host, and the new left padding is a fresh array made from them, so neither
the next filter nor `extract` (which reads it too) waits on the device. The keys', values' and
offsets' gathers stay lazy, as in mlx-lm, and the trim is the same. A padding array that is not evaluated yet (rows that joined
after the last forward was dispatched) is waited for, as before. mlxd's own `BatchQuantizedKVCache`
filters this way always (kv/quantized_batch.py). On by default; `MLXD_BATCH_FILTER=0` keeps mlx-lm's.
"""

from __future__ import annotations

from typing import Any

ENV = "MLXD_BATCH_FILTER"

_ORIGINAL: dict[str, Any] = {}


def wanted() -> bool:
    """Whether it is on: unset or "" (the default), "1", "on" or "true"; "0", "off" or "false" turn it off.
    Another value is a ValueError (`runtime.config.env_switch`)."""
    from mlxd.runtime.config import env_switch

    return env_switch(ENV, default=True)


def install(*, force: bool = False) -> bool:
    """Patch mlx-lm's BatchKVCache.filter once per process when asked for (`force`: regardless of the
    environment, for tests and benches); returns whether it is patched."""
    from mlx_lm.models.cache import BatchKVCache

    from mlxd.kv.quantized_batch import kept_padding

    if _ORIGINAL:
        return True
    if not force and not wanted():
        return False
    original = BatchKVCache.filter

    def filter_unqueued(self: Any, batch_indices: Any) -> None:
        indices = [int(i) for i in batch_indices]
        if not indices:  # (mlx-lm's callers clear an emptied batch instead; its own behaviour then)
            original(self, batch_indices)
            return
        if self.keys is not None:
            self.keys = self.keys[indices]
            self.values = self.values[indices]
        self.offset = self.offset[indices]
        self.left_padding, shared = kept_padding(self.left_padding, indices)
        if shared > 0:  # the columns every kept row pads: trimmed, as mlx-lm does
            if self.keys is not None:
                self.keys = self.keys[..., shared:, :]
                self.values = self.values[..., shared:, :]
            self._idx -= shared

    BatchKVCache.filter = filter_unqueued
    _ORIGINAL.update(filter=original)
    return True


def uninstall() -> None:
    from mlx_lm.models.cache import BatchKVCache

    if _ORIGINAL:
        BatchKVCache.filter = _ORIGINAL["filter"]
        _ORIGINAL.clear()
