"""A pairwise matrix over the `mlxd serve` flags that change wiring, each combination a real server.

Every pair of flag values the CLI accepts meets in at least one combination (the
flags: --ssd-cache/--ssd-layout, --ssd-shared, --ssd-cache-verify, --kv-bits,
--generation-checkpoint, --kv-events-endpoint, --kv-events-token-ids,
--memory-budget, --device-probe, --device-warmup, --api-key, --record-trace, --retention,
--speculative, --kv-admission, --host-cache-gb, --ram-pages, --restore-choice, --restore-overlap,
--ssd-write-hold-decode, --ssd-backlog-gb,
and the environment's MLXD_FINAL_PLAN, which moves when a reply's final checkpoint is taken, MLXD_PLAN_PACK_MB,
which writes small checkpoints from one packed copy, MLXD_BATCH_FILTER, whose off keeps mlx-lm's own batch filter,
MLXD_PLAN_STREAM, the stream checkpoints' slices are evaluated on, MLXD_PLAN_DEVICE, whose off makes SSD
write plans of host views, not device addresses: the same here, off CUDA, and MLXD_KEEP_BUFFERS, whose off clears
MLX's buffer cache after each of mlx-lm's prompt chunks, MLXD_FIRST_TOKEN_EARLY, whose off hands a lone row's
first token out a step later, MLXD_JOIN_FIRST_EARLY, whose on hands rows joining decoding rows theirs a step sooner, MLXD_SSD_DIRECT, whose off
writes write-behind's full-speed slices through the page cache;
and a short --prefill-step-size, with which a lone prompt is
prefilled apart, a slice a step, before it joins the batch: engine/apart.py); each
combination serves a conversation's follow-up turn from the RAM tier, flushes, and
exits 0 on SIGTERM.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import attrs
import msgpack
import pytest
import zmq
from allpairspy import AllPairs

from mlxd.model import build_model

from gateway import free_port
from procs import ServeProcess

# Each flag's values; the first is what the server gets when the flag is left out.
FLAGS: dict[str, tuple[object, ...]] = {
    "ssd": ("off", "whole", "blocks"),  # --ssd-cache DIR --ssd-layout whole|blocks
    "memory_budget": (None, "0", "1"),  # GB; "0" = no budget
    "retention": ("lru", "lfu", "cost"),
    "ssd_shared": (False, True),
    "ssd_verify": ("on", "off"),  # --ssd-cache-verify off: restores check only header, layout and size
    "kv_bits": (None, 8),
    "generation_checkpoint": (0, 4),
    "kv_events": (False, True),
    "kv_token_ids": (False, True),  # --kv-events-token-ids on
    "device_probe": ("off", "on"),
    "api_key": (False, True),
    "record_trace": (False, True),
    "speculative": ("off", "ngram"),
    "kv_admission": (False, True),
    "host_cache": (None, "1"),  # GB; a reported no-op on this CPU (unified memory)
    "ram_pages": ("off", "on"),  # --ram-pages on: RAM entries as shared KV pages
    # --restore-choice, always given (tests/conftest.py sets MLXD_RESTORE_CHOICE=always for the rest)
    # never: the recompute arm (benchmarks); overlap: every cold prefix an overlapped split (kv/restore_decision.py)
    "restore_choice": ("measured", "always", "never", "overlap"),
    "restore_overlap": ("on", "off"),  # --restore-overlap off: the measured choice weighs no overlapped split
    "write_hold": (False, True),  # --ssd-write-hold-decode: write-behind holds still while rows decode
    "backlog": (None, "0.001"),  # --ssd-backlog-gb: ~1 MB, so every checkpoint's write-behind is urgent
    "final_plan": ("after-forward", "with-token", "after-token"),  # MLXD_FINAL_PLAN (the environment; the default first)
    "plan_pack": (None, "1"),  # MLXD_PLAN_PACK_MB (the environment): plans of up to 1 MB from one packed copy
    "batch_filter": ("on", "off"),  # MLXD_BATCH_FILTER (the environment): off keeps mlx-lm's own batch filter
    "plan_stream": ("side", "main"),  # MLXD_PLAN_STREAM (the environment): checkpoints' slices on the side stream
    "plan_device": ("on", "off"),  # MLXD_PLAN_DEVICE (the environment): SSD write plans by device address (CUDA)
    # --device-warmup: auto runs none on this CPU (as off does: tests/test_restore_overlap.py), on runs the probe's
    # longest prefill before listening
    "device_warmup": ("auto", "on"),
    # --prefill-step-size 32: the conversation's prompts are a whole step or more, so each one that finds the batch
    # empty is prefilled apart a slice a step (engine/apart.py); batch: the default step, longer than any prompt here
    "prefill": ("batch", "apart"),
    "keep_buffers": ("on", "off"),  # MLXD_KEEP_BUFFERS (the environment): off, mlx-lm's buffer-cache clear after
    # every prompt chunk (on, the default, keeps the buffers for the next chunk)
    "first_token": ("early", "late"),  # MLXD_FIRST_TOKEN_EARLY (the environment): late, a lone row's first token
    # with the step after the one that sampled it, as mlx-lm hands it out
    "join_first": ("off", "on"),  # MLXD_JOIN_FIRST_EARLY (the environment): on, rows joining decoding rows get their
    # first token with the step that sampled it too
    "ssd_direct": ("on", "off"),  # MLXD_SSD_DIRECT (the environment): off, write-behind's full-speed slices buffered
}
API_KEY = "matrix-key"
SYSTEM = "You are a meticulous assistant. Always answer in full sentences. " * 6


def allowed(combo: Mapping[str, object]) -> bool:
    """False where the CLI refuses a combination on purpose, or ignores a flag (partial combinations too)."""
    ssd = combo.get("ssd")
    if combo.get("ssd_shared") and ssd == "off":
        return False  # ignored without --ssd-cache
    if combo.get("generation_checkpoint") and ssd == "off":
        return False  # refused: "--generation-checkpoint needs the SSD tier"
    if combo.get("write_hold") and ssd == "off":
        return False  # no write-behind without the SSD tier
    if combo.get("backlog") is not None and ssd == "off":
        return False  # no write-behind backlog without the SSD tier
    if combo.get("ssd_verify") == "off" and ssd == "off":
        return False  # nothing is restored without the SSD tier
    if combo.get("kv_token_ids") and combo.get("kv_events") is False:
        return False  # ignored (with a warning) without --kv-events-endpoint
    if combo.get("final_plan") == "after-token" and ssd == "off":
        return False  # ignored without the SSD tier (engine/core.py `_late_final`)
    if combo.get("final_plan") in ("after-token", "after-forward") and combo.get("speculative") == "ngram":
        return False  # ignored with speculation (engine/core.py `_late_final`)
    if combo.get("plan_pack") is not None and ssd == "off":
        return False  # no write plans without the SSD tier (engine/core.py `_pack_bytes`)
    if combo.get("ram_pages") == "on" and combo.get("host_cache") is not None:
        return False  # refused: "--ram-pages on and --host-cache-gb do not combine yet"
    if combo.get("device_warmup") == "on" and combo.get("device_probe") == "off":
        return False  # refused: "--device-warmup on runs the device probe's longest prefill: it needs the probe"
    if combo.get("restore_choice") == "overlap" and ssd == "off":
        return False  # nothing is restored without the SSD tier
    if combo.get("restore_overlap") == "off" and (ssd == "off" or combo.get("restore_choice", "measured") != "measured"):
        return False  # ignored: only the measured choice over an SSD tier weighs overlapped splits
    if combo.get("first_token") == "late" and combo.get("speculative") == "ngram":
        return False  # ignored with speculation (engine/core.py `_early_first`)
    if combo.get("join_first") == "on" and (combo.get("first_token") == "late" or combo.get("speculative") == "ngram"):
        return False  # ignored without the first token early (engine/core.py `_join_early`)
    if combo.get("ssd_direct") == "off" and ssd == "off":
        return False  # nothing is written without the SSD tier
    return True


Pair = tuple[str, object, str, object]


def pairs_of(combo: Mapping[str, object]) -> set[Pair]:
    return {(a, combo[a], b, combo[b]) for a, b in itertools.combinations(combo, 2)}


def _completes(factors: Mapping[str, tuple[object, ...]], keep: Callable[[Mapping[str, object]], bool],
               partial: dict[str, object], rest: list[str]) -> bool:
    """Whether some allowed whole combination extends `partial` over the flags in `rest` (depth first)."""
    if not rest:
        return True
    name, *others = rest
    return any(keep(c := {**partial, name: v}) and _completes(factors, keep, c, others) for v in factors[name])


def reachable_pairs(factors: Mapping[str, tuple[object, ...]], keep: Callable[[Mapping[str, object]], bool]) -> set[Pair]:
    """Every pair of flag values that some whole allowed combination holds.

    `keep` judges partial combinations too and refuses one only for a rule it already breaks, so a
    depth-first completion decides each pair exactly; it agreed with listing all 663,552 combinations
    (before --ssd-write-hold-decode doubled them), which took 24 s of CPU at each import (and 80-120 s
    in the coverage test under CI's load)."""
    names = list(factors)
    return {(a, va, b, vb) for a, b in itertools.combinations(names, 2) for va in factors[a] for vb in factors[b]
            if keep({a: va, b: vb}) and _completes(factors, keep, {a: va, b: vb}, [n for n in names if n not in (a, b)])}


def pairwise(factors: Mapping[str, tuple[object, ...]], keep: Callable[[Mapping[str, object]], bool]) -> list[dict]:
    """allpairspy's combinations, topped up, then thinned: under a filter its greedy search can leave
    a few allowed pairs out, so add combinations until none is, each built flag by flag from a missing
    pair of the flags most missing pairs involve, every flag taking the value (of those an allowed
    completion still follows) that covers most missing pairs with the flags already set; then drop
    each combination (last first) whose pairs the others all hold. Listing every combination to pick
    the best top-up cost 46 s at each import with 21 flags (196 s with 23); this takes under a second
    and ends with fewer servers (17 against 18)."""
    names = list(factors)

    def named(values: Iterable[object]) -> dict[str, object]:  # allpairspy's filter gets partial rows
        return dict(zip(names, values, strict=False))

    def covers(row: Mapping[str, object], name: str, value: object, missing: set[Pair]) -> int:
        return sum((a == name and va == value and row.get(b) == vb) or (b == name and vb == value and row.get(a) == va)
                   for a, va, b, vb in missing)

    rows = [named(r) for r in AllPairs(list(factors.values()), filter_func=lambda r: keep(named(r)))]
    wanted = reachable_pairs(factors, keep)
    missing = wanted - set().union(*map(pairs_of, rows))
    while missing:
        involved = Counter([p[0] for p in missing] + [p[2] for p in missing])
        a, va, b, vb = min(missing, key=lambda p: (-involved[p[0]] - involved[p[2]], names.index(p[0]),
                                                   names.index(p[2]), repr(p)))
        row: dict[str, object] = {a: va, b: vb}
        for name in names:
            if name in row:
                continue
            rest = [n for n in names if n not in row and n != name]
            fits = [v for v in factors[name] if keep(c := {**row, name: v}) and _completes(factors, keep, c, rest)]
            row[name] = max(fits, key=lambda v: covers(row, name, v, missing))  # the first of equals
        row = {n: row[n] for n in names}  # in FLAGS order, as pairs_of reads it
        rows.append(row)
        missing -= pairs_of(row)
    for i in reversed(range(len(rows))):
        others = rows[:i] + rows[i + 1:]
        if wanted <= set().union(*map(pairs_of, others)):
            rows = others
    return rows


@attrs.frozen(kw_only=True)
class Combo:
    """One `mlxd serve` flag combination of the matrix."""

    ssd: str
    memory_budget: str | None
    retention: str
    ssd_shared: bool
    ssd_verify: str
    kv_bits: int | None
    generation_checkpoint: int
    kv_events: bool
    kv_token_ids: bool
    device_probe: str
    api_key: bool
    record_trace: bool
    speculative: str
    kv_admission: bool
    host_cache: str | None
    ram_pages: str = "off"
    restore_choice: str = "measured"
    restore_overlap: str = "on"
    write_hold: bool = False
    backlog: str | None = None
    final_plan: str = "with-token"
    plan_pack: str | None = None
    batch_filter: str = "on"
    plan_stream: str = "side"
    plan_device: str = "on"
    device_warmup: str = "auto"
    prefill: str = "batch"
    keep_buffers: str = "on"
    first_token: str = "early"
    join_first: str = "off"
    ssd_direct: str = "on"

    @property
    def id(self) -> str:
        """E.g. `ssd_whole-shared-kv8-ckpt4-events-budget1-probe-key-trace-lfu`; left-out flags are absent."""
        parts = {
            "ram" if self.ssd == "off" else f"ssd_{self.ssd}": True,
            "shared": self.ssd_shared,
            "noverify": self.ssd_verify == "off",
            f"kv{self.kv_bits}": self.kv_bits is not None,
            f"ckpt{self.generation_checkpoint}": self.generation_checkpoint > 0,
            "events": self.kv_events,
            "ids": self.kv_token_ids,
            f"budget{self.memory_budget}": self.memory_budget is not None,
            "probe": self.device_probe == "on",
            "warm": self.device_warmup == "on",
            "key": self.api_key,
            "trace": self.record_trace,
            "ngram": self.speculative == "ngram",
            "admission": self.kv_admission,
            f"host{self.host_cache}": self.host_cache is not None,
            "pages": self.ram_pages == "on",
            "always": self.restore_choice == "always",
            "never": self.restore_choice == "never",
            "overlap": self.restore_choice == "overlap",
            "nooverlap": self.restore_overlap == "off",
            "hold": self.write_hold,
            "urgent": self.backlog is not None,
            "lateplan": self.final_plan == "after-token",
            "withtoken": self.final_plan == "with-token",
            "packed": self.plan_pack is not None,
            "mlxfilter": self.batch_filter == "off",
            "planmain": self.plan_stream == "main",
            "hostread": self.plan_device == "off",
            "apart": self.prefill == "apart",
            "clears": self.keep_buffers == "off",
            "late1st": self.first_token == "late",
            "join1st": self.join_first == "on",
            "buffered": self.ssd_direct == "off",
            self.retention: True,
        }
        return "-".join(name for name, present in parts.items() if present)

    def serve_args(self, *, model_dir: Path, workdir: Path, events_endpoint: str | None) -> list[str]:
        args = ["--model", str(model_dir), "--model-name", "tiny", "--retention", self.retention,
                "--device-probe", self.device_probe, "--restore-choice", self.restore_choice]
        if self.ssd != "off":
            args += ["--ssd-cache", str(workdir / "ssd"), "--ssd-layout", self.ssd]
        if self.ssd_shared:
            args.append("--ssd-shared")
        if self.ssd_verify == "off":
            args += ["--ssd-cache-verify", "off"]
        if self.kv_bits is not None:
            args += ["--kv-bits", str(self.kv_bits)]
        if self.generation_checkpoint:
            args += ["--generation-checkpoint", str(self.generation_checkpoint)]
        if events_endpoint is not None:
            args += ["--kv-events-endpoint", events_endpoint]
        if self.kv_token_ids:
            args += ["--kv-events-token-ids", "on"]
        if self.memory_budget is not None:
            args += ["--memory-budget", self.memory_budget]
        if self.api_key:
            args += ["--api-key", API_KEY]
        if self.record_trace:
            args += ["--record-trace", str(workdir / "trace.jsonl")]
        if self.speculative != "off":
            args += ["--speculative", self.speculative]
        if self.kv_admission:
            args.append("--kv-admission")
        if self.host_cache is not None:
            args += ["--host-cache-gb", self.host_cache]
        if self.ram_pages == "on":
            args += ["--ram-pages", "on"]
        if self.restore_overlap == "off":
            args += ["--restore-overlap", "off"]
        if self.device_warmup != "auto":
            args += ["--device-warmup", self.device_warmup]
        if self.write_hold:
            args.append("--ssd-write-hold-decode")
        if self.backlog is not None:
            args += ["--ssd-backlog-gb", self.backlog]
        if self.prefill == "apart":
            args += ["--prefill-step-size", "32"]
        return args

    def env(self) -> dict[str, str]:
        env = {"MLXD_FINAL_PLAN": self.final_plan} if self.final_plan != "after-forward" else {}
        env |= {"MLXD_BATCH_FILTER": "0"} if self.batch_filter == "off" else {}
        env |= {"MLXD_PLAN_STREAM": "main"} if self.plan_stream == "main" else {}
        env |= {"MLXD_PLAN_DEVICE": "0"} if self.plan_device == "off" else {}
        env |= {"MLXD_KEEP_BUFFERS": "0"} if self.keep_buffers == "off" else {}
        env |= {"MLXD_FIRST_TOKEN_EARLY": "0"} if self.first_token == "late" else {}
        env |= {"MLXD_JOIN_FIRST_EARLY": "1"} if self.join_first == "on" else {}
        env |= {"MLXD_SSD_DIRECT": "0"} if self.ssd_direct == "off" else {}
        return env | ({"MLXD_PLAN_PACK_MB": self.plan_pack} if self.plan_pack is not None else {})


COMBOS = [Combo(**row) for row in pairwise(FLAGS, allowed)]


class Subscriber:
    """A vLLM-style KV-event subscriber: binds SUB on a free port; the server's PUB connects."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(self.endpoint)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.events: list[list] = []

    def wait_connected(self, timeout: float = 60.0) -> None:
        assert self.monitor.poll(int(timeout * 1000)), "the server's publisher never connected"
        self.monitor.recv_multipart()
        # The subscription reaches the new peer only while the socket is being called.
        end = time.monotonic() + 0.5
        self.drain(lambda: time.monotonic() > end)

    def drain(self, until: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, f"events so far: {self.events}"
            if self.sock.poll(100):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events.extend(msgpack.unpackb(payload)[1])

    def stored(self, medium: str) -> list[list]:
        return [e for e in self.events if e[0] == "BlockStored" and e[6] == medium]

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "test" preset with head_dim 64: --kv-bits needs head_dim divisible by the group size (>= 32)."""
    return build_model(tmp_path_factory.mktemp("models") / "tiny-wide", "test-wide", seed=0)


def chat(http, messages: list[dict]) -> dict:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "temperature": 0,
                                                "max_tokens": 8})
    assert r.status_code == 200, r.text
    return r.json()


def read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_matrix_covers_every_allowed_pair() -> None:
    wanted = reachable_pairs(FLAGS, allowed)
    assert len(wanted) == 2213, "FLAGS or allowed() changed: recount the allowed pairs"
    assert wanted <= set().union(*(pairs_of(attrs.asdict(c)) for c in COMBOS))
    assert all(allowed(attrs.asdict(c)) for c in COMBOS)
    assert len({c.id for c in COMBOS}) == len(COMBOS) <= 28  # each a server start: keep it small


@pytest.mark.parametrize("combo", COMBOS, ids=[c.id for c in COMBOS])
def test_serve_combination(combo: Combo, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue("wide_model_dir" if combo.kv_bits else "tiny_model_dir")
    sub = Subscriber() if combo.kv_events else None
    args = combo.serve_args(model_dir=model_dir, workdir=tmp_path, events_endpoint=sub and sub.endpoint)
    headers = {"Authorization": f"Bearer {API_KEY}"} if combo.api_key else {}
    try:
        with ServeProcess(*args, log_path=tmp_path / "serve.log", env=combo.env()) as proc, proc.client() as http:
            http.headers.update(headers)
            if sub is not None:
                sub.wait_connected()
            if combo.api_key:
                assert http.post("/v1/chat/completions", headers={"Authorization": "Bearer wrong"},
                                 json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 401

            turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a cache?"}]
            first = chat(http, turn1)
            turn2 = [*turn1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Tell me more."}]
            follow_up = chat(http, turn2)
            assert follow_up["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a RAM hit

            stats = http.get("/stats").json()
            assert stats["cache"]["ram"]["policy"] == combo.retention
            if combo.memory_budget == "0":  # no budget: no memory governor
                assert "memory" not in stats["cache"]
            else:
                budget = stats["cache"]["memory"]["budget_bytes"]
                assert budget == 2**30 if combo.memory_budget == "1" else budget > 0  # default: a share of RAM
            assert ("device_probe" in stats) == (combo.device_probe == "on")
            if combo.device_probe == "on":  # a warm-up ran only where asked for ("auto": none on this CPU)
                warmup = stats["device_probe"]["warmup"]
                assert (warmup is not None) == (combo.device_warmup == "on"), warmup
                assert warmup is None or warmup["tokens"] == stats["device_probe"]["prefill"][-1]["tokens"], warmup
            late = stats["engine"].get("late_final_checkpoints")  # both replies' finals a step late, or None
            assert late == (None if combo.final_plan == "with-token" else 2), stats["engine"]  # (allowed(): no
            # late mode beside speculation, after-token only with the SSD tier)
            packed = stats["engine"].get("packed_plans")  # the replies' checkpoints (under 1 MB) packed, or None
            assert (packed is None) == (combo.plan_pack is None) and (packed is None or packed >= 2), stats["engine"]
            if combo.speculative == "ngram":  # on, or off with the reason (quantized KV cannot roll back)
                speculation = stats["engine"]["speculation"]
                assert speculation["active"] == (combo.kv_bits is None), speculation
                assert (speculation["off_reason"] is None) == (combo.kv_bits is None), speculation
            if combo.host_cache is not None:  # unified memory: the flag is a reported no-op
                host = stats["cache"]["host"]
                assert host["enabled"] is False and host["requested_bytes"] == 2**30 and host["reason"], host
            ram = stats["cache"]["ram"]
            assert (ram["pages"] > 0) == (combo.ram_pages == "on") and ram["bytes"] <= ram["checkpoint_bytes"], ram
            assert ("ssd_cache" in stats) == (combo.ssd != "off")
            if combo.ssd != "off":
                assert stats["ssd_cache"]["layout"] == combo.ssd
                assert ("shared" in stats["ssd_cache"]) == combo.ssd_shared

            flush = http.post("/admin/cache/flush")
            if combo.ssd == "off":
                assert flush.status_code == 400, flush.text
                assert "no SSD tier" in flush.json()["error"]["message"]
            else:
                assert flush.status_code == 200, flush.text
                report = flush.json()
                assert report["durable"] is True and report["pending"] == 0 and report["failed"] == 0
                assert report["longest_durable_prefix_tokens"] >= follow_up["usage"]["prompt_tokens"]
                if combo.generation_checkpoint:
                    assert report["generation_checkpoints_pending"] == 0

            if sub is not None:
                sub.drain(lambda: sub.stored("RAM"))
                # Token ids travel only when asked for (--kv-events-token-ids on).
                assert all(bool(e[3]) == combo.kv_token_ids for e in sub.stored("RAM")), sub.stored("RAM")
                if combo.ssd != "off":
                    sub.drain(lambda: sub.stored("SSD"))

            proc.signal(signal.SIGTERM)
            assert proc.wait() == 0, proc.log()
            # the first turn's prompt, alone in the engine, was prefilled apart exactly with the short step
            done = [json.loads(line) for line in proc.log().splitlines() if '"request.done"' in line]
            assert ("apart" in done[0]["first_token_ms"]) == (combo.prefill == "apart"), done[0]
    finally:
        if sub is not None:
            sub.close()

    if combo.record_trace:
        trace = read_trace(tmp_path / "trace.jsonl")
        assert trace[0]["event"] == "server"
        served = [line for line in trace if "tokens" in line]
        assert len(served) == 2 and served[1]["cached_tokens"] > 0
        # With the SSD tier: the admin flush, then the one at shutdown.
        assert len([line for line in trace if line.get("event") == "flush"]) == (2 if combo.ssd != "off" else 0)
