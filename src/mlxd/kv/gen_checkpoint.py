"""In-flight generation checkpoints (seed §5.7): the request key, the record, the write queue.

Every N generated tokens the engine snapshots a running row at a boundary
where its caches cover the prompt and every emitted token, and the next token
is already sampled but not yet emitted (the *pending* token; mlx-lm's
`GenerationBatch` samples one step ahead). A checkpoint file stores both
pieces atomically: the ordinary `.mlxkv` tensors and tokens (prompt + emitted)
plus a `generation` record in the hashed header (this module's
`GenerationRecord`). After a crash or restart, an identical request (same
`request_key`) adopts the caches, replays the emitted tokens and the pending
one through the ordinary response, and continues with the sampler state the
record saved, so a greedy or seeded request produces exactly the text an
uninterrupted run would have.

Pure: no MLX, no trio. `CheckpointQueue` keeps the newest job per request key
(a newer snapshot replaces a queued older one; completion replaces a queued
snapshot with a removal) and knows which request owns a key, so the cleanup of
an older attempt never erases a newer attempt's checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

EXTENSION = ".mlxgen"
RECORD_VERSION = 1


def checkpointable(sampling: Any) -> bool:
    """Can this request be resumed by token replay? (logprobs cannot be replayed in v1)."""
    return not sampling.logprobs and sampling.top_logprobs == 0


def request_key(prompt: Sequence[int], namespace: str, sampling: Any) -> str:
    """A hash of everything that decides a generation: prompt ids, namespace, every sampling field.

    The model, tokenizer and KV scheme are covered by the directory the
    checkpoint lives in (the store fingerprint).
    """
    fields = attrs.asdict(sampling)
    doc = {"v": RECORD_VERSION, "namespace": namespace, "sampling": fields}
    h = hashlib.sha256(json.dumps(doc, sort_keys=True, default=list).encode())
    h.update(b"\0")
    h.update(array("q", prompt).tobytes())
    return h.hexdigest()[:32]


def file_name(key: str) -> str:
    return key + EXTENSION


@attrs.frozen
class GenerationRecord:
    """What a checkpoint adds to its snapshot: enough to continue the generation exactly.

    The snapshot's tokens are `prompt + emitted` (what the caches cover);
    `pending` is the already-sampled next token; `rng_key` is the sampler's
    key after `len(emitted) + 1` samples (None for greedy).
    """

    key: str
    prompt_tokens: int
    emitted: tuple[int, ...] = attrs.field(converter=lambda t: tuple(int(x) for x in t))
    pending: int
    rng_key: tuple[int, ...] | None = None

    def as_doc(self) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "key": self.key,
            "prompt_tokens": self.prompt_tokens,
            "emitted": len(self.emitted),
            "pending": self.pending,
            "rng_key": None if self.rng_key is None else list(self.rng_key),
        }

    @classmethod
    def from_header(cls, doc: dict[str, Any] | None, tokens: Sequence[int]) -> GenerationRecord:
        """Rebuild from a header's `generation` object and tokens; ValueError if malformed."""
        try:
            if doc is None or doc["version"] != RECORD_VERSION:
                raise ValueError("not a generation checkpoint of this version")
            n_prompt, n_emitted = _int(doc["prompt_tokens"]), _int(doc["emitted"])
            if n_prompt < 1 or n_emitted < 0 or n_prompt + n_emitted != len(tokens):
                raise ValueError("token counts do not match the snapshot")
            rng = doc["rng_key"]
            return cls(
                key=_str(doc["key"]),
                prompt_tokens=n_prompt,
                emitted=tuple(tokens[n_prompt:]),
                pending=_int(doc["pending"]),
                rng_key=None if rng is None else tuple(_int(x) for x in rng),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed generation record: {exc!r}") from exc


def _int(x: Any) -> int:
    if type(x) is not int:
        raise TypeError(f"expected int, got {type(x).__name__}")
    return x


def _str(x: Any) -> str:
    if type(x) is not str:
        raise TypeError(f"expected str, got {type(x).__name__}")
    return x


@attrs.frozen
class UnwrittenCheckpoints:
    """Generation checkpoints whose newest snapshot failed to reach the disk (what a flush reports)."""

    count: int = 0
    error: str | None = None  # one failed write's cause (the OS's words)

    @classmethod
    def of(cls, failures: dict[str, str]) -> UnwrittenCheckpoints:
        return cls(len(failures), next(reversed(failures.values()), None))

    @property
    def reason(self) -> str | None:
        if not self.count:
            return None
        return f"{self.count} generation checkpoint write(s) failed: {self.error}"


@attrs.define(eq=False)
class CheckpointEntry:
    """A committed checkpoint file."""

    key: str
    path: Path
    emitted: int  # tokens it replays before continuing (pending excluded)
    nbytes: int
    mtime: float


@attrs.frozen(eq=False)
class WriteJob:
    key: str
    request_id: str
    plan: Any  # kv.file_format.SnapshotPlan
    emitted: int


@attrs.frozen(eq=False)
class RemoveJob:
    key: str
    request_id: str


Job = WriteJob | RemoveJob


@attrs.define
class CheckpointQueue:
    """Newest-per-key jobs plus the owner of each key; the writer takes the oldest key first."""

    _jobs: OrderedDict[str, Job] = attrs.Factory(OrderedDict)
    _owners: dict[str, str] = attrs.Factory(dict)
    superseded: int = 0  # queued snapshots replaced by newer ones before they were written

    def __len__(self) -> int:
        return len(self._jobs)

    def write(self, job: WriteJob) -> None:
        """Queue a snapshot; it replaces a queued older one of the same key."""
        old = self._jobs.pop(job.key, None)
        if isinstance(old, WriteJob):
            self.superseded += 1
        self._jobs[job.key] = job
        self._owners[job.key] = job.request_id

    def adopt(self, key: str, request_id: str) -> None:
        """A request resumed this key's checkpoint: it owns the key now."""
        self._owners[key] = request_id

    def remove(self, key: str, request_id: str) -> bool:
        """Queue the removal of `key`'s checkpoint, unless a newer attempt owns the key."""
        owner = self._owners.get(key)
        if owner is not None and owner != request_id:
            return False
        self._owners.pop(key, None)
        self._jobs.pop(key, None)
        self._jobs[key] = RemoveJob(key, request_id)
        return True

    def release(self, key: str, request_id: str) -> None:
        """The request left without completing (cancelled, failed): keep its checkpoint."""
        if self._owners.get(key) == request_id:
            del self._owners[key]

    def owned(self, key: str) -> bool:
        """Is a live request writing or continuing this key's checkpoint?"""
        return key in self._owners

    @property
    def owners(self) -> int:
        """Keys a live request owns (their checkpoints are not resumable until it leaves)."""
        return len(self._owners)

    def removing(self, key: str) -> bool:
        """Is a removal of `key` queued (its request completed)?"""
        return isinstance(self._jobs.get(key), RemoveJob)

    def take(self) -> Job | None:
        """The oldest queued job, or None."""
        if not self._jobs:
            return None
        _, job = self._jobs.popitem(last=False)
        return job

    def pending_bytes(self) -> int:
        return sum(j.plan.nbytes for j in self._jobs.values() if isinstance(j, WriteJob))
