"""A lone row's cache into mlx-lm's batch and on to generation without copies (`MLXD_BATCH_HANDOVER`).

mlx-lm's `BatchGenerator` copies a joining row's whole KV twice before its first token, on top of the
copy its first decode step makes when it grows the cache: `BatchKVCache.merge` allocates a zeroed
batch buffer and writes the row's keys and values into it, and `PromptProcessingBatch.split`, moving
rows to generation, deep-copies the prompt batch's caches and then gathers the moved rows out of them.
For a 16k-token prefix of the 1.7B shape each copy is 1.88 GB to allocate and move (an H200's hit
spent 50-61 ms in its two generator steps). For the common case they copy for nothing:

- one row merged alone, with no padding: its keys and values are the batch's (a view of the lent
  arrays; the first update grows the buffer into a new array, so the cache entry is never written);
- every row of the prompt batch moving to generation: the batch is handed over as it is, and the
  emptied prompt batch keeps nothing.

Anything else (several rows, padding, other cache classes) takes mlx-lm's own path. The H200 (18:48,
`mlxd_ram_handover` against `mlxd_ram`, 3 rounds): a hit's forward 49 -> 38 ms, a next turn's 133 ->
106 ms, its client time 0.826x. On by default; `MLXD_BATCH_HANDOVER=0` keeps mlx-lm's copies.
"""

from __future__ import annotations

from typing import Any

ENV = "MLXD_BATCH_HANDOVER"

_ORIGINAL: dict[str, Any] = {}


def wanted() -> bool:
    """Whether it is on: unset or "" (the default), "1", "on" or "true"; "0", "off" or "false" turn it off.
    Another value is a ValueError (`runtime.config.env_switch`)."""
    from mlxd.runtime.config import env_switch

    return env_switch(ENV, default=True)


def install(*, force: bool = False) -> bool:
    """Patch mlx-lm's BatchKVCache.merge and PromptProcessingBatch.split once per process when asked for
    (`force`: regardless of the environment, for tests); returns whether they are patched."""
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import BatchKVCache, KVCache

    if _ORIGINAL:
        return True
    if not force and not wanted():
        return False
    merge, split = BatchKVCache.merge.__func__, PromptProcessingBatch.split

    def merge_alone(cls: Any, caches: list[Any]) -> Any:
        if len(caches) == 1 and type(caches[0]) is KVCache and caches[0].keys is not None and cls is BatchKVCache:
            c, n = caches[0], int(caches[0].offset)
            if n > 0 and c.keys.shape[0] == 1:
                cache = BatchKVCache([0])
                cache.keys, cache.values = c.keys[..., :n, :], c.values[..., :n, :]
                cache.offset += n
                cache._idx = n
                return cache
        return merge(cls, caches)

    def split_whole(self: Any, indices: list[int]) -> Any:
        if sorted(indices) != list(range(len(self.uids))):
            return split(self, indices)
        moved = self.__class__.__new__(self.__class__)
        moved.__dict__.update(self.__dict__)
        for name in ("uids", "prompt_cache", "tokens", "samplers", "logits_processors", "stop_sequences",
                     "max_tokens"):
            setattr(moved, name, list(getattr(self, name)))
        self.filter([])  # empties this batch's own lists; the caches go with `moved`, uncopied
        return moved

    BatchKVCache.merge = classmethod(merge_alone)
    PromptProcessingBatch.split = split_whole
    _ORIGINAL.update(merge=merge, split=split)
    return True


def uninstall() -> None:
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import BatchKVCache

    if _ORIGINAL:
        BatchKVCache.merge = classmethod(_ORIGINAL["merge"])
        PromptProcessingBatch.split = _ORIGINAL["split"]
        _ORIGINAL.clear()
