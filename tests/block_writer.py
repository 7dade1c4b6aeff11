"""Test helper: a real process that writes block checkpoints until it is killed.

    python tests/block_writer.py ROOT SEED MODE [MAX_WRITES]

Conversations share a system prompt, grow, and branch; every fifth write
drops an old checkpoint (its manifest) and collects the garbage. The process
prints one JSON line per event, flushed before it moves on:

    {"durable": PATH, "digest": TOKENS_SHA}   the manifest is committed
    {"dropping": PATH}                         about to unlink this manifest

MODE says how it dies: "random" (the parent kills it), "block" (SIGKILLs
itself in the middle of a block write), "manifest" (in the middle of a
manifest write, with a partial tmp on disk), "gc" (between two unlinks of a
collection), "none" (exits after MAX_WRITES).

KV values depend only on the tokens up to each position, as attention KV
does, so the checker recomputes every tensor from the tokens alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np

from mlxd.kv import block_store as bs
from mlxd.kv import file_format as ff
from mlxd.kv.blocks import BlockLedger
from mlxd.kv.pacing import Pacer
from mlxd.kv.ssd_store import Failed, SsdStore, StoreIdentity, compute_fingerprint
from mlxd.kv.tiers import SsdRecord

IDENTITY = StoreIdentity("crash", compute_fingerprint({"test": "block-crash"}), "tok")
BLOCK_TOKENS = 64
LAYERS, HEADS, DIM = 2, 2, 64
SYSTEM = list(range(1, 301))  # shared by every conversation


def expected(tokens) -> list[np.ndarray]:
    """The tensors of the checkpoint after `tokens` (K and V of every layer)."""
    t = np.cumsum(np.asarray(tokens, dtype=np.float64)) % 65521
    out = []
    for layer in range(LAYERS):
        base = (t[None, None, :, None] * (layer + 1) + np.arange(DIM)[None, None, None, :]).astype(np.float32)
        k = np.concatenate([base + h for h in range(HEADS)], axis=1)
        out += [k, -k]
    return out


def plan(tokens) -> ff.SnapshotPlan:
    arrays = expected(tokens)
    n = len(tokens)
    caches = tuple(
        ff.CacheDesc(
            kind="kv",
            offset=n,
            tensors=tuple(ff.TensorDesc("float32", a.shape, a.nbytes) for a in arrays[2 * i : 2 * i + 2]),
        )
        for i in range(LAYERS)
    )
    return ff.SnapshotPlan(IDENTITY.meta(tokens, ""), caches, tuple(memoryview(a) for a in arrays))


def digest(tokens) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


def say(**event: object) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillingPacer(Pacer):
    """Slow writes (so a random kill lands inside one); in "block" mode, die after `after` slices."""

    def __init__(self, after: int | None) -> None:
        super().__init__(rate_bytes_per_s=40e6, slice_bytes=64 << 10)
        self.after = after

    def done(self, nbytes: int) -> None:
        if self.after is not None:
            self.after -= 1
            if self.after <= 0:
                die()
        super().done(nbytes)


def main(root: str, seed: int, mode: str, max_writes: int) -> None:
    rng = random.Random(seed)
    store = SsdStore(Path(root), IDENTITY, layout="blocks", block_tokens=BLOCK_TOKENS)
    pacer = KillingPacer(rng.randint(3, 40) if mode == "block" else None)
    manifest_kill = rng.randint(1, 6) if mode == "manifest" else None
    gc_kill = mode == "gc"
    real_write, real_unlink = bs._write_durably, bs._unlink_quietly

    def partial_manifest(path: Path, data: bytes) -> None:
        nonlocal manifest_kill
        manifest_kill -= 1  # type: ignore[operator]
        if manifest_kill > 0:  # type: ignore[operator]
            return real_write(path, data)
        fd = os.open(path.with_name(path.name + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data[: len(data) // 2])
        die()

    def unlink_then_die(path: Path) -> None:
        real_unlink(path)
        if path.suffix == bs.BLOCK_EXT:
            die()

    if manifest_kill is not None:
        bs._write_durably = partial_manifest  # type: ignore[assignment]
    conversations: list[list[int]] = []
    live: list[SsdRecord] = []
    ledger = BlockLedger()  # as the cache tiers count them
    for step in range(max_writes):
        choice = rng.random()
        if not conversations or choice < 0.3:
            tokens = SYSTEM + [rng.randrange(1000, 2000) for _ in range(rng.randint(5, 120))]
            conversations.append(tokens)
        elif choice < 0.8:
            tokens = conversations[rng.randrange(len(conversations))]
            tokens += [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 150))]
        else:
            base = conversations[rng.randrange(len(conversations))]
            tokens = base[: rng.randint(len(SYSTEM), len(base))] + [rng.randrange(2000, 3000)]
            conversations.append(tokens)
        result = store.write(plan(tokens), pacer)
        if isinstance(result, Failed):
            say(failed=result.error)
            continue
        say(durable=str(result.record.path), digest=digest(tokens))
        live.append(result.record)
        ledger.add(result.record.blocks)
        if step % 5 == 4 and len(live) > 2:
            old = live.pop(rng.randrange(len(live) - 1))
            say(dropping=str(old.path))
            if gc_kill:
                bs._unlink_quietly = unlink_then_die  # type: ignore[assignment]
            store.unlink(old, ledger.remove(old.blocks))  # the manifest, then its garbage
    say(done=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 10**9)
