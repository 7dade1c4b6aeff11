"""Request traces: Mooncake JSON lines, mlxd's own JSONL format, and a recorder.

Mooncake lines look like `{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`: one id per 512-token block, each id covering its block and
every block before it, so equal leading ids mean a shared prefix.

mlxd lines (docs/simulate.md) carry explicit tokens or text:
`{"t": seconds, "namespace": "", "session": null, "tokens": [...] | "text": "...",
"output_tokens": m, "cached_tokens": k | null, "cache_tier": "ram" | "ssd" | "none",
"output_ids": [...] (optional), "ttft_s": s, "queued_s": s (measured, when recorded),
"parts": {"lookup_s": s, "fetch_s": s, "read_s": s, "land_s": s, "verify_s": s} (where the server's TTFT went;
read by no replay; land_s and verify_s are parts of read_s, recordings since 3ab129d, 2026-12-05)}`.
`TraceRecorder` writes this format from live traffic (`mlxd serve --record-trace`),
plus event lines: `{"event": "server", ...}` (the server's cache configuration,
first) and `{"event": "flush", "t": seconds}` (an `/admin/cache/flush`), so a
recording replays the recorded server with no other flags (`load_recording`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO

import attrs
import numpy as np

from mlxd.kv.cost_model import BLOCK_TOKENS

Tokenize = Callable[[str], Sequence[int]]


@attrs.frozen(kw_only=True)
class TraceRequest:
    """One request of a trace, in either format."""

    index: int
    t: float  # arrival, seconds since the first request
    input_length: int
    output_tokens: int
    namespace: str = ""
    session: str | None = None
    hash_ids: tuple[int, ...] | None = None  # Mooncake
    tokens: tuple[int, ...] | None = None  # mlxd format
    output_ids: tuple[int, ...] | None = None  # mlxd format: generated ids, when recorded
    cached_tokens: int | None = None  # what the live server reported, when recorded
    cache_tier: str | None = None  # where the live server found it ("ram", "ssd", "none")
    pin_s: float = 0.0  # a pin of the request's session (24h retention, cache_control TTL), seconds
    ttft_s: float | None = None  # the live server's measured time to first token, when recorded
    queued_s: float | None = None  # ... and time waiting for a batch slot
    kv_waited: bool = False  # the live server's --kv-admission held it back for memory, when recorded
    # The page-cache bytes of the SSD candidate the live server's restore advisor weighed (per block; a whole
    # file: one number), when recorded: a replay weighs the same (the OS's page cache is not simulated)
    resident: tuple[int, ...] | None = None

    def block_ids(self) -> tuple[int, ...]:
        """The Mooncake block ids; a ValueError for a request that has none (mlxd format)."""
        if self.hash_ids is None:
            raise ValueError(f"request {self.index}: no hash_ids (not a Mooncake request)")
        return self.hash_ids


def utf8_tokens(text: str) -> list[int]:
    """Fallback tokenizer for text-only traces: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def parse_line(obj: dict, index: int, tokenize: Tokenize = utf8_tokens) -> TraceRequest:
    """A TraceRequest from one decoded JSON line (either format); `t` not yet rebased."""
    if "hash_ids" in obj:
        return TraceRequest(
            index=index,
            t=obj["timestamp"] / 1000.0,
            input_length=int(obj["input_length"]),
            output_tokens=int(obj.get("output_length", 0)),
            hash_ids=tuple(obj["hash_ids"]),
        )
    if obj.get("tokens") is not None:
        tokens = tuple(int(x) for x in obj["tokens"])
    elif obj.get("text") is not None:
        tokens = tuple(tokenize(obj["text"]))
    else:
        raise ValueError(f"trace line {index + 1}: needs hash_ids, tokens or text")
    out_ids = obj.get("output_ids")
    return TraceRequest(
        index=index,
        t=float(obj.get("t", 0.0)),
        input_length=len(tokens),
        output_tokens=int(obj.get("output_tokens", len(out_ids or ()))),
        namespace=obj.get("namespace") or "",
        session=obj.get("session"),
        tokens=tokens,
        output_ids=None if out_ids is None else tuple(int(x) for x in out_ids),
        cached_tokens=obj.get("cached_tokens"),
        cache_tier=obj.get("cache_tier"),
        pin_s=float(obj.get("pin_s") or 0.0),
        ttft_s=None if obj.get("ttft_s") is None else float(obj["ttft_s"]),
        queued_s=None if obj.get("queued_s") is None else float(obj["queued_s"]),
        kv_waited=bool(obj.get("kv_waited", False)),
        resident=None if obj.get("resident") is None else tuple(int(x) for x in obj["resident"]),
    )


@attrs.frozen
class Recording:
    """A trace with what `mlxd serve --record-trace` adds: the server's configuration and its flushes."""

    reqs: list[TraceRequest]
    server: dict | None = None  # the `{"event": "server"}` line, when recorded
    flushes: tuple[float, ...] = ()  # flush times, on the requests' rebased clock
    calibrations: tuple[dict | None, ...] = ()  # the restore advisor's state at each flush


def load_recording(
    path: str | Path, *, limit: int | None = None, tokenize: Tokenize = utf8_tokens
) -> Recording:
    """Every request of a JSONL trace (rebased, in arrival order), its server and its flushes."""
    reqs: list[TraceRequest] = []
    server = None
    flushes: list[tuple[float, dict | None]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"trace line {n}: not JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"trace line {n}: not a JSON object")
            event = obj.get("event")
            if event == "server":
                server = obj
            elif event == "flush":
                flushes.append((float(obj["t"]), obj.get("restore_advisor")))
            elif event is None and (limit is None or len(reqs) < limit):
                reqs.append(parse_line(obj, len(reqs), tokenize))
    t0 = min((r.t for r in reqs), default=0.0)
    last = max((r.t for r in reqs), default=0.0)
    kept = sorted((t - t0, cal) for t, cal in flushes if t <= last or limit is None)
    return Recording(rebase(reqs), server, tuple(t for t, _ in kept), tuple(cal for _, cal in kept))


def load_trace(
    path: str | Path, *, limit: int | None = None, tokenize: Tokenize = utf8_tokens
) -> list[TraceRequest]:
    """Every request of a JSONL trace, arrival times rebased to start at 0, in arrival order."""
    return load_recording(path, limit=limit, tokenize=tokenize).reqs


def rebase(reqs: Iterable[TraceRequest]) -> list[TraceRequest]:
    """Sort by arrival (stable) and shift times so the first request arrives at 0."""
    reqs = sorted(reqs, key=lambda r: r.t)
    t0 = reqs[0].t if reqs else 0.0
    return [attrs.evolve(r, t=r.t - t0, index=i) for i, r in enumerate(reqs)]


def is_mooncake(reqs: Sequence[TraceRequest]) -> bool:
    return bool(reqs) and all(r.hash_ids is not None for r in reqs)


# --- synthesized token ids for Mooncake traces ---------------------------------


def block_tokens(hash_ids: Sequence[int], input_length: int) -> np.ndarray:
    """Token ids for a Mooncake request: block id h expands to h*512 .. h*512+511.

    Equal ids give equal tokens, different ids differ at their first token, and
    the last block is cut to `input_length`.
    """
    ids = np.asarray(hash_ids, dtype=np.int64)
    toks = (ids[:, None] * BLOCK_TOKENS + np.arange(BLOCK_TOKENS)).ravel()[:input_length]
    return toks.astype(np.int32)


def half_block_tokens(hash_ids: Sequence[int]) -> np.ndarray:
    """Two synthetic tokens per block, (2h, 2h+1): the block-granular fast path.

    See `mlxd.sim.replay.BlockSynth` for why this reproduces token-level hits exactly.
    """
    ids = np.asarray(hash_ids, dtype=np.int64)
    return np.stack([2 * ids, 2 * ids + 1], axis=1).ravel().astype(np.int32)


def check_block_structure(reqs: Sequence[TraceRequest]) -> None:
    """Raise if a Mooncake trace breaks what block-granular replay relies on.

    Every request must have ceil(input_length / 512) ids, and an id must always
    cover the same number of tokens (a partial last block has its own id).
    """
    fill: dict[int, int] = {}
    for r in reqs:
        n, ids = r.input_length, r.hash_ids or ()
        if len(ids) != -(-n // BLOCK_TOKENS):
            raise ValueError(f"request {r.index}: {len(ids)} hash ids for {n} tokens")
        for j, h in enumerate(ids):
            f = min(BLOCK_TOKENS, n - j * BLOCK_TOKENS)
            if fill.setdefault(h, f) != f:
                raise ValueError(f"hash id {h} covers {fill[h]} and {f} tokens")


# --- recording live traffic ---------------------------------------------------


@attrs.define
class TraceRecorder:
    """Append one mlxd-format line per finished request; flushed per line.

    Synchronous and thread-safe; the server calls `record` when a request ends.
    Times are seconds from `clock()` (pass the serving clock).
    """

    path: Path = attrs.field(converter=Path)
    _file: IO[str] | None = attrs.field(init=False, default=None)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def record(
        self,
        *,
        t: float,
        tokens: Sequence[int],
        output_tokens: int,
        namespace: str = "",
        session: str | None = None,
        cached_tokens: int | None = None,
        cache_tier: str | None = None,
        output_ids: Sequence[int] | None = None,
        ttft_s: float | None = None,
        queued_s: float | None = None,
        kv_waited: bool = False,
        parts: dict[str, float] | None = None,
        resident: Sequence[int] | None = None,
    ) -> None:
        line: dict[str, object] = {
            "t": t,
            "namespace": namespace,
            "session": session,
            "tokens": [int(x) for x in tokens],
            "output_tokens": int(output_tokens),
            "cached_tokens": cached_tokens,
        }
        if cache_tier is not None:
            line["cache_tier"] = cache_tier
        if output_ids is not None:
            line["output_ids"] = [int(x) for x in output_ids]
        if ttft_s is not None:
            line["ttft_s"] = round(ttft_s, 6)
        if queued_s is not None:
            line["queued_s"] = round(queued_s, 6)
        if kv_waited:
            line["kv_waited"] = True
        if parts:  # where the TTFT went, as the server saw it (a replay reads none of it)
            line["parts"] = {k: round(float(v), 6) for k, v in parts.items()}
        if resident is not None:  # the SSD candidate's page-cache bytes the restore advisor weighed
            line["resident"] = [int(x) for x in resident]
        self._write(line)

    def server(self, **config: object) -> None:
        """The recorded server's cache configuration (what `mlxd simulate` replays)."""
        self._write({"event": "server", **config})

    def flush(self, *, t: float, restore_advisor: dict[str, float] | None = None) -> None:
        """A flush started at `t` (a barrier when replayed), with the restore advisor's calibration."""
        line: dict[str, object] = {"event": "flush", "t": t}
        if restore_advisor is not None:
            line["restore_advisor"] = restore_advisor
        self._write(line)

    def _write(self, line: dict[str, object]) -> None:
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "a")  # noqa: SIM115 (held open until close)
            self._file.write(text)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
