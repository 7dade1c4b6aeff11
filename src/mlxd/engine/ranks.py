"""`--distributed`: rank 0 and its followers drive the same engine core (runtime/distributed.py).

`Leader` wraps rank 0's core: each step goes to the followers first, with the
mirrored prefix each start lends, and only then runs here. `follow` is a
follower rank's whole life: load, then run every step rank 0 sends through
its own core, keeping its shard of each checkpoint (kv/shard_mirror.py).
"""

from __future__ import annotations

import attrs

from mlxd.engine.core import EngineCore
from mlxd.engine.ops import RowStart, StepOps, StepResult
from mlxd.kv.shard_mirror import (
    FollowerShards,
    LeaderMirror,
    MissingShard,
    PrefixRef,
    ShardRef,
    shard_key,
)
from mlxd.runtime import gc_pauses
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.distributed import StepChannel, pin_seed
from mlxd.runtime.kernel.messages import PublishPrefix
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.engine")


class Leader:
    """Rank 0: tell the followers each step, then run it on this rank's core (engine thread only).

    With the prompt cache, a start says which mirrored prefix it lends, and the
    followers confirm they hold every one before anyone steps: a follower that
    does not fails the step on every rank (then a reset) rather than decode
    from another prefix than rank 0's.
    """

    def __init__(self, core: EngineCore, channel: StepChannel, *, mirrored: bool) -> None:
        self._core = core
        self._channel = channel
        self._mirror = LeaderMirror() if mirrored else None
        self._forgotten: list[ShardRef] = []  # keys a failed step stopped lending: dropped with the reset
        self._stepping = False  # inside a step: a failure there loses the step's checkpoints
        self._misses = 0

    def step(self, ops: StepOps) -> StepResult:
        if ops.reset:
            self._channel.send(attrs.evolve(ops, drops=(*ops.drops, *self._forgotten), discard=self._stepping))
            self._forgotten, self._stepping = [], False
            return self._core.step(ops)
        ops = self._mirrored(ops)
        self._channel.send(ops)
        if ops.lends and self._channel.gather_missing():
            refs = [p for p in ops.prefixes if p is not None]
            for ref in refs:  # never lent again: hits on them start cold
                if self._mirror is not None:
                    self._mirror.forget(ref.key)
            self._forgotten.extend(ShardRef(ref.key, 0) for ref in refs)
            raise MissingShard(f"a follower rank lacks its shard of a cached prefix this step lends ({len(refs)})")
        self._stepping = True
        result = self._core.step(ops)
        self._stepping = False
        return self._published(result)

    def shutdown(self) -> None:
        """The followers are waiting for the next step: tell them to stop."""
        self._channel.send(StepOps(shutdown=True))

    def _mirrored(self, ops: StepOps) -> StepOps:
        """The same seed on every rank; a RAM hit only where every follower holds its shard.

        No SSD tier when distributed (RuntimeConfig refuses it): no restores, no resumes.
        """
        starts = tuple(self._lendable(attrs.evolve(s, request=pin_seed(s.request), restore=None, resume=None, tail=None))
                       for s in ops.starts)
        prefixes = tuple(self._prefix(s) for s in starts)
        mirror = self._mirror
        drops = tuple(ref for ref in ops.drops if mirror is not None and mirror.dropped(ref))
        return attrs.evolve(
            ops, starts=starts, prefixes=prefixes if any(p is not None for p in prefixes) else (), drops=drops
        )

    def _lendable(self, start: RowStart) -> RowStart:
        hit = start.hit
        if hit is None:
            return start
        if hit.usable > 0 and self._mirror is not None and self._mirror.holds(_key(start)):
            return start
        if self._mirror is not None:
            self._misses += 1
        return attrs.evolve(start, hit=None)  # a cache miss on every rank, never a wrong prefix

    @staticmethod
    def _prefix(start: RowStart) -> PrefixRef | None:
        hit = start.hit
        if hit is None:
            return None
        return PrefixRef(_key(start), hit.usable, len(hit.entry.tokens))

    def _published(self, result: StepResult) -> StepResult:
        """Every rank kept the same checkpoints: the followers hold them now."""
        mirror = self._mirror
        if mirror is None:
            return result
        notes = tuple(
            attrs.evolve(n, shard=mirror.published(shard_key(n.namespace, n.tokens)))
            if isinstance(n, PublishPrefix) else n
            for n in result.notes
        )
        stats = attrs.evolve(result.stats, mirrored_prefixes=len(mirror), mirror_misses=self._misses)
        return attrs.evolve(result, notes=notes, stats=stats)


def _key(start: RowStart) -> str:
    assert start.hit is not None
    return shard_key(start.hit.entry.namespace, start.hit.entry.tokens)


def follow(config: RuntimeConfig) -> None:
    """A follower rank's whole life, on the calling thread: load, then replay rank 0's steps.

    Returns when rank 0 shuts down. A step that fails here resets the core;
    rank 0 then fails the same step and says so (`reset`); any other next
    step means the ranks diverged, and the follower stops.

    With the prompt cache, this rank keeps its shard of every checkpoint its
    steps produce (the same ones rank 0's cache owner receives) until rank 0
    says its owner dropped them, and lends them when a start names their key.
    A start from a key not held here is refused before the step: this rank
    tells rank 0 (`confirm`), which fails the step and resets every rank.
    """
    core = EngineCore(config)
    core.load()
    if gc_pauses.freeze_wanted():  # the heap start-up made: no full collection walks it again (as rank 0)
        log.info("engine.gc_frozen", **gc_pauses.freeze_heap())
    channel = core.channel
    assert channel is not None and channel.rank > 0
    shards = FollowerShards()
    added: list[str] = []  # keys the latest step added (forgotten if rank 0 failed that step)
    failed = False
    try:
        while True:
            ops = channel.receive()
            if ops.shutdown:
                return
            missing = shards.missing_keys(ops.prefixes)
            if ops.lends:
                channel.confirm(len(missing))
            dropped = [ref.key for ref in ops.drops]
            if ops.reset:
                shards.drop_all([*dropped, *(added if ops.discard else ())])
                added, failed = [], False
                core.step(ops)
                continue
            if failed:
                raise RuntimeError("rank 0 went on after a step that failed here: the ranks diverged")
            if missing:  # rank 0 fails this step and resets every rank
                shards.missing += len(missing)
                log.error("engine.shard_missing", keys=missing, held=len(shards))
                shards.drop_all(dropped)
                failed = True
                continue
            prefixes = ops.prefixes or (None,) * len(ops.starts)
            starts = tuple(s if p is None else attrs.evolve(s, hit=shards.lend(p))
                           for s, p in zip(ops.starts, prefixes, strict=True))
            shards.drop_all(dropped)  # lent rows keep what they borrowed
            added = []
            try:
                result = core.step(attrs.evolve(ops, starts=starts))
            except Exception:
                log.exception("engine.follower_step_failed")
                core.reset()
                failed = True
                continue
            for note in result.notes:
                if isinstance(note, PublishPrefix):
                    key = shard_key(note.namespace, note.tokens)
                    if key not in shards:
                        added.append(key)
                    shards.hold(note.namespace, note.tokens, note.payload, nbytes=note.nbytes,
                                trimmable=note.trimmable)
    finally:
        log.info("engine.follower_shards", rank=channel.rank, **shards.summary())
        core.close()
        channel.close()
