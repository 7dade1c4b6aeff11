"""Content-addressed blocks vs whole files, side by side in one run (seed §5.11 C1).

    python benchmarks/bench_ssd_blocks.py [--dir DIR] [--conversations 8] [--turns 3]

Workload (issue 14's): `--conversations` conversations share a
`--system-tokens` system prompt (an agent's tools and rules); each turn's
prompt adds the previous reply and a new user message, and its prompt
checkpoint is flushed to SSD (write-behind with a flush after every turn). Then
`--branches` conversations branch at an earlier turn (a retry or an edit).
Both stores see the same checkpoints, in the same order, and apply the cache
tiers' supersession rule: a trimmable checkpoint replaces every stored
checkpoint whose tokens are a prefix of its own (for blocks: their manifests
go, their blocks stay while another manifest names them; garbage is
collected right away).

Measured per store: flush cost (every checkpoint's write, tmp + fsync +
rename: total seconds and MB/s), bytes written per checkpoint (for follow-ups in the same
conversation, against the KV of the tokens added since its previous
checkpoint), bytes retained at the end (every file on disk) against the
deduplicated KV (the KV of the distinct prefixes of every retained
checkpoint, each token once), and restore bandwidth of the longest
checkpoint — read + adopt into MLX from a cold page cache — against the raw
sequential read of a plain file of the same size (alternating order, median;
the load alone, before adopt, is recorded too).
Block restores run once per `--readers` count (how many block files one load
reads at once), side by side; with `--landing` (default) whole files and
blocks are also restored straight into MLX arrays (`kinds.landing`, no copy
at adopt), named `..._mlx`. A last probe reads the same 192 MiB cold as
6 MiB files, 24 MiB files and one file, one file at a time, with every file
announced to the kernel up front (WILLNEED), and 4 or 8 files at a time, to
separate the disk's cost per file (and per outstanding request) from the
block reader's.

KV shape: `--layers` x `--kv-heads` x `--head-dim`, fp32 (24 KiB per token by
default, as the "bench" model preset; ratios do not depend on the shape beyond
per-block page padding).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_ssd_io  # noqa: E402

import mlxd  # noqa: E402, F401  (OpenBLAS preload before mlx)
from mlxd.kv import block_store as bs  # noqa: E402
from mlxd.kv import blocks as bk  # noqa: E402
from mlxd.kv import file_format as ff  # noqa: E402
from mlxd.kv import kinds  # noqa: E402
from mlxd.kv.ssd_store import StoreIdentity, compute_fingerprint  # noqa: E402
from mlxd.kv.tiers import SsdRecord  # noqa: E402

IDENTITY = StoreIdentity("bench", compute_fingerprint({"bench": "ssd_blocks"}), "tok")


class Conversation:
    """Token ids plus K/V arrays per layer that grow with them (numpy, as a plan needs them)."""

    def __init__(self, tokens: list[int], kv: list[np.ndarray]) -> None:
        self.tokens = tokens
        self.kv = kv  # per layer: K then V, each (1, H, n, D)

    def extend(self, new: list[int], rng: np.random.Generator) -> None:
        shape = self.kv[0].shape
        add = [rng.standard_normal((1, shape[1], len(new), shape[3]), dtype=np.float32) for _ in self.kv]
        self.kv = [np.concatenate([a, b], axis=2) for a, b in zip(self.kv, add, strict=True)]
        self.tokens = self.tokens + new

    def branch(self, at: int) -> Conversation:
        return Conversation(self.tokens[:at], [np.ascontiguousarray(a[:, :, :at, :]) for a in self.kv])

    def plan(self) -> ff.SnapshotPlan:
        n = len(self.tokens)
        caches = tuple(
            ff.CacheDesc(
                kind="kv", offset=n,
                tensors=tuple(ff.TensorDesc("float32", a.shape, a.nbytes) for a in self.kv[i : i + 2]),
            )
            for i in range(0, len(self.kv), 2)
        )
        return ff.SnapshotPlan(IDENTITY.meta(self.tokens, ""), caches, tuple(memoryview(a) for a in self.kv))


def workload(args: argparse.Namespace) -> list[tuple[str, int, Conversation]]:
    """The checkpoints in order: (kind, new tokens since the conversation's last checkpoint, state)."""
    rng = random.Random(args.seed)
    nrng = np.random.default_rng(args.seed)
    layers = [np.zeros((1, args.kv_heads, 0, args.head_dim), np.float32) for _ in range(2 * args.layers)]
    system = Conversation([], layers)
    system.extend([rng.randrange(100, 30000) for _ in range(args.system_tokens)], nrng)
    convs = [system.branch(len(system.tokens)) for _ in range(args.conversations)]
    turn_ends: list[list[int]] = [[] for _ in convs]
    out: list[tuple[str, int, Conversation]] = []

    def words(lo: int, hi: int) -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(rng.randint(lo, hi))]

    last = [0] * len(convs)  # tokens at each conversation's previous checkpoint
    for turn in range(args.turns):
        for i, c in enumerate(convs):
            c.extend(words(*args.user_tokens), nrng)  # the prompt: history + a new user message
            kind = "first" if turn == 0 else "follow-up"
            out.append((kind, len(c.tokens) - (last[i] or len(system.tokens)), c.branch(len(c.tokens))))
            last[i] = len(c.tokens)
            turn_ends[i].append(len(c.tokens))
            c.extend(words(*args.reply_tokens), nrng)  # the reply, part of the next prompt
    for b in range(args.branches):
        i = b % len(convs)
        at = turn_ends[i][0]  # retry the second turn with another question
        c = convs[i].branch(at)
        c.extend(words(*args.user_tokens), nrng)
        out.append(("branch", len(c.tokens) - at, c))
    return out


class Supersession:
    """The tiers' rule: a new trimmable checkpoint replaces stored checkpoints that are prefixes of it."""

    def __init__(self) -> None:
        self.live: dict[tuple[int, ...], Any] = {}

    def commit(self, tokens: tuple[int, ...], record: Any) -> list[Any]:
        gone = [r for t, r in self.live.items() if tokens[: len(t)] == t]
        self.live = {t: r for t, r in self.live.items() if tokens[: len(t)] != t}
        self.live[tokens] = record
        return gone


def dedup_tokens(token_lists: list[tuple[int, ...]]) -> int:
    """Distinct prefixes over all lists (trie nodes): every token of shared prefixes once."""
    seen: set[tuple[int, ...]] = set()
    root: dict[int, Any] = {}
    count = 0
    for toks in token_lists:
        node = root
        for t in toks:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                count += 1
            node = nxt
    del seen
    return count


def du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def write_trace(path: Path, checkpoints: list[tuple[str, int, Conversation]]) -> None:
    """The workload as an mlxd trace (`mlxd simulate`): one request per checkpoint, 100 s apart (each
    write and flush done before the next), one generated token, the prompt as the checkpoint."""
    with open(path, "w") as f:
        for i, (_, _, conv) in enumerate(checkpoints):
            f.write(json.dumps({"t": 100.0 * i, "namespace": "", "tokens": conv.tokens, "output_tokens": 1}) + "\n")


def run_storage(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    checkpoints = workload(args)
    if args.trace_out is not None:
        write_trace(args.trace_out, checkpoints)
    per_token = 2 * args.layers * args.kv_heads * args.head_dim * 4
    whole_dir = work / "whole"
    whole_dir.mkdir()
    whole_live = Supersession()
    arms = {
        bt: (bs.BlockStore(work / f"blocks-{bt}", IDENTITY, block_tokens=bt), Supersession(), bk.BlockLedger())
        for bt in args.block_tokens
    }
    rows = []
    for n, (kind, new, conv) in enumerate(checkpoints):
        plan = conv.plan()
        tokens = plan.meta.tokens
        t0 = time.perf_counter()
        written = ff.write_snapshot(plan, whole_dir / f"{n:05d}.mlxkv")
        row: dict[str, Any] = {
            "kind": kind, "tokens": len(tokens), "new_tokens": new, "new_kv_bytes": new * per_token,
            "whole_written": written.nbytes, "whole_write_s": time.perf_counter() - t0,
        }
        for old in whole_live.commit(tokens, written.path):
            old.unlink()
        for bt, (store, live, ledger) in arms.items():
            t0 = time.perf_counter()
            result = store.write(plan)
            ledger.add(result.record.blocks)
            garbage: list[str] = []
            for old in live.commit(tokens, result.record):
                old.path.unlink()
                garbage += ledger.remove(old.blocks)
            if garbage:
                store.collect(garbage)
            row.update({
                f"blocks{bt}_written": result.written_bytes, f"blocks{bt}_write_s": time.perf_counter() - t0,
                f"blocks{bt}_new": result.new_blocks, f"blocks{bt}_reused": result.reused_blocks,
                f"blocks{bt}_files": len(result.record.blocks),
            })
        rows.append(row)
    live_tokens = list(whole_live.live)
    dedup = dedup_tokens(live_tokens) * per_token
    follow = [r for r in rows if r["kind"] == "follow-up"]
    branches = [r for r in rows if r["kind"] == "branch"]

    def ratio(key: str, rs: list[dict[str, Any]]) -> dict[str, float] | None:
        xs = [r[key] / r["new_kv_bytes"] for r in rs]
        return {"median": statistics.median(xs), "max": max(xs), "mean": statistics.fmean(xs)} if xs else None

    def flush(written: str, seconds: str) -> dict[str, float]:
        """Every checkpoint's write (a flush after every turn): total seconds and bytes per second."""
        total_s = sum(r[seconds] for r in rows)
        return {"flush_s": total_s, "flush_MBps": sum(r[written] for r in rows) / total_s / 1e6}

    whole_retained = du(whole_dir)
    summary: dict[str, Any] = {
        "checkpoints": len(rows), "kv_bytes_per_token": per_token, "retained_checkpoints": len(live_tokens),
        "dedup_kv_bytes": dedup,
        "whole": {
            "retained_bytes": whole_retained, "retained_over_dedup": whole_retained / dedup,
            "written_bytes": sum(r["whole_written"] for r in rows),
            "followup_written_over_new_kv": ratio("whole_written", follow),
            "branch_written_over_new_kv": ratio("whole_written", branches),
            "median_write_s": statistics.median(r["whole_write_s"] for r in rows),
            **flush("whole_written", "whole_write_s"),
        },
        "default_span": bk.span_for(per_token),
        "goal_retained_max": 1.3, "goal_followup_written_max": 1.5,
    }
    for bt, (store, live, ledger) in arms.items():
        assert sorted(live.live) == sorted(live_tokens)
        retained = du(store.directory)
        arm = {
            "block_tokens": bt, "block_bytes": bt * per_token,
            "retained_bytes": retained, "retained_over_dedup": retained / dedup, "ledger_unique_bytes": ledger.bytes,
            "written_bytes": sum(r[f"blocks{bt}_written"] for r in rows),
            "followup_written_over_new_kv": ratio(f"blocks{bt}_written", follow),
            "branch_written_over_new_kv": ratio(f"blocks{bt}_written", branches),
            "median_write_s": statistics.median(r[f"blocks{bt}_write_s"] for r in rows),
            **flush(f"blocks{bt}_written", f"blocks{bt}_write_s"),
            "max_files_per_restore": max(len(r.blocks) for r in live.live.values()),
        }
        arm["flush_s_over_whole"] = arm["flush_s"] / summary["whole"]["flush_s"]
        arm["goal_retained_met"] = arm["retained_over_dedup"] <= 1.3
        follow_ratio = arm["followup_written_over_new_kv"]
        arm["goal_followup_met"] = follow_ratio["max"] <= 1.5 if follow_ratio else None  # no follow-ups: None
        summary[f"blocks_{bt}"] = arm
    print(json.dumps(summary, indent=1), flush=True)
    if args.ram:
        summary["ram"] = run_ram(args, checkpoints, per_token)
        print(json.dumps({"ram": summary["ram"]}, indent=1), flush=True)
    longest = max(live_tokens, key=len)
    conv_restores = {
        "whole": whole_live.live[longest],
        **{bt: (store, live.live[longest]) for bt, (store, live, _) in arms.items()},
    }
    return {"rows": rows, "summary": summary, "longest": conv_restores}


def run_ram(args: argparse.Namespace, checkpoints: list[tuple[str, int, Conversation]],
             per_token: int) -> dict[str, Any]:
    """The RAM tier's side of the same checkpoints: the engine's page pool (`--ram-pages on`,
    kv/page_pool.py) on real MLX arrays, with the tiers' supersession (an entry superseded by a
    trimmable descendant is dropped, so are its pages no other entry names). Retained: the pages'
    unique buffers as the cache owner counts them (`PageLedger`) and MLX active memory grown over the
    run (a measurement beside the accounting); contiguous entries hold each entry's KV whole (the
    live runtime's /stats bytes matched that sum exactly in bench_ram_pages.py)."""
    import gc

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxd.kv.page_pool import PagePool
    from mlxd.kv.ram_pages import PageLedger

    page_tokens = args.ram_page_tokens or bk.span_for(per_token)
    pool = PagePool(fingerprint=IDENTITY.fingerprint, page_tokens=page_tokens)
    ledger = PageLedger()
    live = Supersession()
    gc.collect()
    before = mx.get_active_memory()
    t0 = time.perf_counter()
    for _, _, conv in checkpoints:
        n = len(conv.tokens)
        caches = []
        for i in range(0, len(conv.kv), 2):
            c = KVCache()
            c.keys, c.values, c.offset = mx.array(conv.kv[i]), mx.array(conv.kv[i + 1]), n
            caches.append(c)
        paged = pool.page(caches, conv.tokens, "")
        assert paged is not None
        ledger.add(conv.tokens, paged.refs)
        for old in live.commit(tuple(conv.tokens), paged):
            ledger.remove(old.refs)
        del caches, paged
    gc.collect()
    held = int(mx.get_active_memory() - before)
    entries = list(live.live)
    dedup = dedup_tokens(entries) * per_token
    contiguous = sum(len(t) for t in entries) * per_token
    return {
        "page_tokens": page_tokens, "entries": len(entries), "pages": len(pool), "dedup_kv_bytes": dedup,
        "pages_retained_bytes": ledger.bytes, "pages_retained_over_dedup": ledger.bytes / dedup,
        "pages_mlx_active_grown_bytes": held, "pages_mlx_active_over_dedup": held / dedup,
        "contiguous_retained_bytes": contiguous, "contiguous_retained_over_dedup": contiguous / dedup,
        "goal_retained_max": 1.2, "goal_retained_met": ledger.bytes / dedup <= 1.2 and held / dedup <= 1.2,
        "page_copies": pool.made, "page_views": pool.views, "pages_reused": pool.reused,
        "seconds": time.perf_counter() - t0,
    }


def run_bandwidth(args: argparse.Namespace, work: Path, longest: dict[Any, Any]) -> dict[str, Any]:
    """Restore cold, alternating: a fresh long checkpoint (whole file, blocks of each size), the
    longest conversation of the storage run as each store left it (partial blocks included),
    and the raw sequential read of a plain copy. Each against the raw read of the same round.
    Block restores run once per `--readers` count (blocks read at once), named `..._r<N>`."""
    import gc

    nrng = np.random.default_rng(args.seed)
    layers = [np.zeros((1, args.kv_heads, 0, args.head_dim), np.float32) for _ in range(2 * args.layers)]
    conv = Conversation([], layers)
    conv.extend(list(range(1, args.bandwidth_tokens + 1)), nrng)
    plan = conv.plan()
    whole_path = ff.write_snapshot(plan, work / "bw.mlxkv").path
    plain = work / "plain.bin"
    shutil.copyfile(whole_path, plain)
    flush = fresh_writes(args, work, plan)
    stores: dict[str, tuple[bs.BlockStore, SsdRecord, int, bool]] = {}
    for bt in args.block_tokens:
        store = bs.BlockStore(work / f"bw-{bt}", IDENTITY, block_tokens=bt)
        record = store.write(plan).record
        for n in args.readers:
            stores[f"blocks_{bt}_r{n}"] = (store, record, n, False)
            stores[f"conversation_blocks_{bt}_r{n}"] = (*longest[bt], n, False)
        if args.landing:
            stores[f"blocks_{bt}_mlx"] = (store, record, bs.READERS, True)
            stores[f"conversation_blocks_{bt}_mlx"] = (*longest[bt], bs.READERS, True)
    del plan

    def cold(paths: list[Path]) -> None:
        for p in paths:
            bench_ssd_io.drop_cache(p)

    def restore_blocks(
        store: bs.BlockStore, record: SsdRecord, readers: int, land: bool
    ) -> tuple[float, int, float]:
        cold([store.block_path(b.name) for b in record.blocks] + [record.path])
        store.readers = readers
        t0 = time.perf_counter()
        loaded = store.load(record, verify=args.verify, land=kinds.landing if land else None)
        t1 = time.perf_counter()
        restored = kinds.adopt(loaded)
        t2 = time.perf_counter()
        assert restored[0].offset == len(record.tokens)
        del loaded, restored
        gc.collect()
        return t2 - t0, sum(b.file_bytes for b in record.blocks), t1 - t0

    def restore_whole(path: Path, land: bool = False) -> tuple[float, int, float]:
        cold([path])
        t0 = time.perf_counter()
        loaded = ff.read_snapshot(path, verify=args.verify, land=kinds.landing if land else None)
        t1 = time.perf_counter()
        restored = kinds.adopt(loaded)
        t2 = time.perf_counter()
        del loaded, restored
        gc.collect()
        return t2 - t0, path.stat().st_size, t1 - t0

    def raw() -> tuple[float, int, float]:
        seconds = bench_ssd_io.raw_read(plain)
        return seconds, plain.stat().st_size, seconds

    steps: dict[str, Any] = {
        "raw": raw,
        "whole": lambda: restore_whole(whole_path),
        "conversation_whole": lambda: restore_whole(longest["whole"]),
    }
    if args.landing:
        steps["whole_mlx"] = lambda: restore_whole(whole_path, True)
        steps["conversation_whole_mlx"] = lambda: restore_whole(longest["whole"], True)
    steps.update({name: (lambda sr=sr: restore_blocks(*sr)) for name, sr in stores.items()})
    for name, fn in steps.items():
        if name != "raw":
            fn()  # first touch of fresh memory, not measured
    names = list(steps)
    rounds = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        row: dict[str, Any] = {"round": r, "order": order}
        for name in order:
            seconds, nbytes, read_s = steps[name]()
            row[f"{name}_MBps"] = nbytes / seconds / 1e6
            row[f"{name}_read_MBps"] = nbytes / read_s / 1e6  # the load alone, before adopt
            row[f"{name}_adopt_ms"] = (seconds - read_s) * 1e3
        for name in names:
            row[f"{name}_ratio"] = row[f"{name}_MBps"] / row["raw_MBps"]
            row[f"{name}_read_ratio"] = row[f"{name}_read_MBps"] / row["raw_MBps"]
        rounds.append(row)
        print(f"  round {r}: " + "  ".join(f"{k} {row[k + '_MBps']:.0f}" for k in names) + " MB/s", flush=True)
    summary: dict[str, Any] = {
        "tokens": args.bandwidth_tokens, "bytes": whole_path.stat().st_size, "verify": args.verify,
        "conversation_tokens": len(longest[args.block_tokens[0]][1].tokens),
        "files": {k: len(rec.blocks) for k, (_, rec, _, _) in stores.items()},
        "readers_default": bs.READERS,
        "median_MBps": {k: statistics.median(r[f"{k}_MBps"] for r in rounds) for k in names},
        "median_ratio_to_raw": {k: statistics.median(r[f"{k}_ratio"] for r in rounds) for k in names},
        "median_read_only_ratio_to_raw": {
            k: statistics.median(r[f"{k}_read_ratio"] for r in rounds) for k in names if k != "raw"
        },
        "median_adopt_ms": {k: statistics.median(r[f"{k}_adopt_ms"] for r in rounds) for k in names if k != "raw"},
        "goal_ratio_min": 0.8,
        "fresh_flush": flush,
    }
    summary["goal_met"] = {k: v >= 0.8 for k, v in summary["median_ratio_to_raw"].items() if k != "raw"}
    print(json.dumps(summary, indent=1), flush=True)
    return {"rounds": rounds, "summary": summary}


def fresh_writes(args: argparse.Namespace, work: Path, plan: ff.SnapshotPlan) -> dict[str, Any]:
    """Flush bandwidth with nothing to share: the same fresh checkpoint written as a whole file and
    as blocks into an empty store (tmp + fsync + rename each), alternating, `--rounds` times."""
    names = ["whole", *(f"blocks_{bt}" for bt in args.block_tokens)]
    rates: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            target = work / f"flush-{name}-{r}"
            t0 = time.perf_counter()
            if name == "whole":
                target.mkdir()
                nbytes = ff.write_snapshot(plan, target / "x.mlxkv").nbytes
            else:
                store = bs.BlockStore(target, IDENTITY, block_tokens=int(name.split("_")[1]))
                nbytes = store.write(plan).written_bytes
            rates[name].append(nbytes / (time.perf_counter() - t0) / 1e6)
            shutil.rmtree(target)
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"median_MBps": med, "over_whole": {k: v / med["whole"] for k, v in med.items()}, "MBps": rates}


def run_file_probe(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Is it the files? Cold sequential reads of the same bytes as many small files or one big one,
    one file at a time (queue depth 1: today's serial loop), with every file announced up front
    (`posix_fadvise(WILLNEED)` on all, then the same loop), and 4 or 8 files at a time (threads)."""
    from concurrent.futures import ThreadPoolExecutor

    total = 192 << 20
    chunk = os.urandom(8 << 20)
    probe = work / "probe"
    probe.mkdir()
    sets: dict[str, list[Path]] = {}
    for size in (6 << 20, 24 << 20, total):
        paths = []
        for i in range(total // size):
            path = probe / f"{size}-{i}"
            with open(path, "wb") as f:
                for off in range(0, size, len(chunk)):
                    f.write(chunk[: min(len(chunk), size - off)])
                f.flush()
                os.fsync(f.fileno())
            paths.append(path)
        sets[f"{size >> 20}MB_files"] = paths

    def read_one(path: Path) -> None:
        buf = memoryview(bytearray(8 << 20))
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    def serial(paths: list[Path]) -> None:
        for p in paths:
            read_one(p)

    def willneed(paths: list[Path]) -> None:
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        try:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            serial(paths)
        finally:
            for fd in fds:
                os.close(fd)

    pools = {n: ThreadPoolExecutor(n) for n in (4, 8)}
    modes: dict[str, Any] = {
        "serial": serial, "willneed": willneed,
        **{f"threads{n}": (lambda paths, pool=pool: list(pool.map(read_one, paths))) for n, pool in pools.items()},
    }
    rates: dict[str, list[float]] = {f"{k}_{m}": [] for k in sets for m in modes}
    for r in range(args.rounds):
        for name, paths in sets.items():
            order = list(modes)[r % len(modes) :] + list(modes)[: r % len(modes)]
            for mode in order:
                for p in paths:
                    bench_ssd_io.drop_cache(p)
                t0 = time.perf_counter()
                modes[mode](paths)
                rates[f"{name}_{mode}"].append(total / (time.perf_counter() - t0) / 1e6)
    for pool in pools.values():
        pool.shutdown()
    shutil.rmtree(probe, ignore_errors=True)
    summary = {k: {"median_MBps": statistics.median(v), "best_MBps": max(v)} for k, v in rates.items()}
    print(json.dumps(summary, indent=1), flush=True)
    return {"rates_MBps": rates, "summary": summary}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=4759)
    p.add_argument("--user-tokens", type=int, nargs=2, default=(40, 200), metavar=("MIN", "MAX"))
    p.add_argument("--reply-tokens", type=int, nargs=2, default=(100, 400), metavar=("MIN", "MAX"))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-tokens", type=int, nargs="+", default=[256, 1024], help="block spans to compare")
    p.add_argument("--rounds", type=int, default=8, help="restore bandwidth rounds")
    p.add_argument("--readers", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="restore bandwidth: blocks one load reads at once (BlockStore.readers), side by side")
    p.add_argument("--landing", action=argparse.BooleanOptionalAction, default=True,
                   help="also restore whole files and blocks (READERS at a time) straight into MLX arrays "
                        "(`land=kinds.landing`, what `--restore-landing mlx` does), named `..._mlx`")
    p.add_argument("--bandwidth-tokens", type=int, default=8000, help="restore bandwidth: checkpoint tokens")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=False,
                   help="restore with per-tensor CRC-32 checks (the tier's default is off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ram", action=argparse.BooleanOptionalAction, default=True,
                   help="storage: also page the same checkpoints in RAM (--ram-pages on's page pool, MLX arrays)")
    p.add_argument("--ram-page-tokens", type=int, default=0, help="RAM page span (0: the SSD default span)")
    p.add_argument("--trace-out", type=Path, default=None,
                   help="also write the workload as an mlxd trace for `mlxd simulate` (one request a checkpoint)")
    p.add_argument("--parts", nargs="+", choices=("storage", "bandwidth", "probe"),
                   default=["storage", "bandwidth", "probe"], help="what to run (storage always runs)")
    p.add_argument("--dir", type=Path, default=None, help="work dir on the disk under test (default /tmp/...)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_ssd_blocks-", dir=args.dir))
    t0 = time.perf_counter()
    try:
        print(f"=== storage: {args.conversations} conversations x {args.turns} turns, {args.branches} branches "
              f"(work dir {work}) ===", flush=True)
        storage = run_storage(args, work)
        bandwidth = probe = None
        if "bandwidth" in args.parts:
            print("=== restore bandwidth ===", flush=True)
            bandwidth = run_bandwidth(args, work, storage.pop("longest"))
        storage.pop("longest", None)
        if "probe" in args.parts:
            print("=== file-size probe: 192 MiB as 6 MiB files, 24 MiB files, one file; 1, all, 4, 8 at a time ===",
                  flush=True)
            probe = run_file_probe(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": "ssd_blocks", "storage": {"rows": storage["rows"], "summary": storage["summary"]},
        "bandwidth": bandwidth, "file_probe": probe, "runtime_s": time.perf_counter() - t0, "loadavg": os.getloadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"ssd_blocks-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out} ({result['runtime_s']:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
