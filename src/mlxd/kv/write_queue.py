"""Write-behind order: the dirty-record state machine behind the durability coordinator.

Every RAM checkpoint that is not on SSD is a dirty record keyed by its
namespace and *exact* tokens (two same-length conversations never cancel each
other). Records are written oldest first, one at a time unless the caller
allows more (an unpaced flush); two versions of one key are never written at
once. A trimmable record
supersedes its queued strict ancestors (it serves them by trimming). A failed
write leaves its record failed until a flush retries it once. A flush waits
for the records dirty when it was called (`open_flush`) and, when one of them
is superseded before its write, for the record that superseded it: only that
write will put the state the flush was asked for on disk. Pure: the serving
coordinator and the simulator's writer drive the same class.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Literal

import attrs

from mlxd.kv.prompt_cache import Tokens
from mlxd.kv.tiers import Key, key_of

if TYPE_CHECKING:
    from mlxd.kv.file_format import SnapshotPlan
    from mlxd.vision.tensor_store import TensorPlan

State = Literal["queued", "writing", "failed"]


@attrs.define
class DirtyRecord:
    namespace: str
    tokens: Tokens
    plan: SnapshotPlan | TensorPlan | None  # a TensorPlan: a vision encoder output
    trimmable: bool
    nbytes: int
    version: int
    state: State = "queued"
    error: str | None = None


@attrs.frozen(eq=False)
class WriteJob:
    """One write for the writer: `version` tells a stale outcome from a current one."""

    key: Key
    version: int
    record: DirtyRecord


@attrs.frozen
class WriteCounters:
    spills: int
    failed_spills: int
    dropped_spills: int
    superseded: int


@attrs.define
class WriteQueue:
    # The store shares a checkpoint's bytes with a shorter one of the same conversation (the blocks layout):
    # then a record whose strict prefix is pending too adds only what it holds beyond it (`pending_bytes`).
    shared_prefixes: bool = attrs.field(default=False, kw_only=True)
    _records: OrderedDict[Key, DirtyRecord] = attrs.field(init=False, factory=OrderedDict)
    _writing: set[Key] = attrs.field(init=False, factory=set)  # keys with a write in flight
    _versions: int = attrs.field(init=False, default=0)
    _flushes: list[set[Key]] = attrs.field(init=False, factory=list)  # open flushes' targets
    spills: int = attrs.field(init=False, default=0)
    failed_spills: int = attrs.field(init=False, default=0)
    dropped_spills: int = attrs.field(init=False, default=0)
    superseded: int = attrs.field(init=False, default=0)
    dropped_since_flush: int = attrs.field(init=False, default=0)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def writing(self) -> int:
        """Writes in flight."""
        return len(self._writing)

    def mark(
        self, namespace: str, tokens: Tokens, *, plan: SnapshotPlan | TensorPlan | None, trimmable: bool, nbytes: int,
        first: bool = False,
    ) -> None:
        """A new checkpoint to write (a newer version of the same tokens replaces a queued one).

        `first` (a pinned checkpoint) puts it ahead of the records already queued.
        """
        key = key_of(namespace, tokens)
        self._versions += 1
        self._records.pop(key, None)  # a version being written finishes; this one gets its own try
        self._records[key] = DirtyRecord(namespace, tokens, plan, trimmable, nbytes, self._versions)
        if first:
            self._records.move_to_end(key, last=False)
        if trimmable:
            for other, record in list(self._records.items()):
                if record.state != "writing" and other[0] == namespace and _strict_prefix(other[1], key[1]):
                    del self._records[other]
                    self.superseded += 1
                    for targets in self._flushes:  # a flush waiting for `other` now waits for this
                        if other in targets:
                            targets.add(key)

    def forget(self, namespace: str, tokens: Tokens) -> None:
        """The RAM entry left without a write: drop its record (counted against the next flush)."""
        key = key_of(namespace, tokens)
        record = self._records.get(key)
        if record is not None and record.state != "writing":
            del self._records[key]
            self.dropped_spills += 1
            self.dropped_since_flush += 1

    def next_job(self, *, limit: int = 1) -> WriteJob | None:
        """The next write, while fewer than `limit` are in flight (never a second one of a key)."""
        if len(self._writing) >= limit:
            return None
        for key, record in self._records.items():
            if record.state == "queued" and key not in self._writing:
                record.state = "writing"
                self._writing.add(key)
                return WriteJob(key, record.version, record)
        return None

    def written(self, key: Key, version: int, *, stored: bool, error: str | None = None) -> bool:
        """The writer's outcome; True when the failure is the record's current version."""
        self._writing.discard(key)
        record = self._records.get(key)
        if stored:
            self.spills += 1
            if record is not None:
                del self._records[key]  # same exact tokens: a newer queued version holds the same state
            return False
        self.failed_spills += 1
        if record is not None and record.version == version:
            record.state = "failed"
            record.error = error
            return True
        return False

    def open_flush(self) -> set[Key]:
        """A flush: one more try for each failed record; returns every key to wait for.

        The set is live until `close_flush`: a trimmable record that supersedes
        one of its keys joins it.
        """
        for record in self._records.values():
            if record.state == "failed":
                record.state = "queued"
        targets = set(self._records)
        self._flushes.append(targets)
        return targets

    def close_flush(self, targets: set[Key]) -> None:
        """The flush was answered: its targets stop following supersession."""
        self._flushes = [t for t in self._flushes if t is not targets]

    def busy(self, keys: set[Key]) -> bool:
        return any(k in self._records and self._records[k].state != "failed" for k in keys)

    def failed(self) -> list[DirtyRecord]:
        return [r for r in self._records.values() if r.state == "failed"]

    def pending(self) -> list[DirtyRecord]:
        return [r for r in self._records.values() if r.state != "failed"]

    def pending_bytes(self) -> int:
        """Bytes still to write. With `shared_prefixes`, a record counts only what it adds to the longest
        pending record it extends: a prompt's final checkpoint queued while its boundary checkpoint is being
        written is one new block on disk, not the prompt's KV a second time (which alone passed the backlog
        bound of a 3 GB RAM tier with one 8k prompt of the 1.7B shape, so write-behind ran at full speed
        beside decode; issue 28)."""
        pending = [(key, r) for key, r in self._records.items() if r.state != "failed"]
        if not self.shared_prefixes:
            return sum(r.nbytes for _, r in pending)
        # In key order, a record's pending strict prefixes are exactly the chain left before it once the keys
        # it does not extend are popped (every key between a prefix and its extension extends that prefix too):
        # one sort, not every pair (called after each message: 95 ms at 1,000 records sharing a prompt).
        total = 0
        chain: list[tuple[Key, int]] = []  # (key, the most bytes of it and the prefixes before it)
        for key, r in sorted(pending, key=lambda kr: kr[0]):
            while chain and not (chain[-1][0][0] == key[0] and _strict_prefix(chain[-1][0][1], key[1])):
                chain.pop()
            base = chain[-1][1] if chain else 0
            total += max(0, r.nbytes - base)
            chain.append((key, max(base, r.nbytes)))
        return total

    def counters(self) -> WriteCounters:
        return WriteCounters(self.spills, self.failed_spills, self.dropped_spills, self.superseded)


def _strict_prefix(short: bytes, long: bytes) -> bool:
    return len(short) < len(long) and long.startswith(short)
