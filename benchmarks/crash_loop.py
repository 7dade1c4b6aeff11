"""Crash consistency: SIGKILL a real `mlxd serve --ssd-cache` at random moments, restart, check.

    python benchmarks/crash_loop.py --kills 200 [--ssd-layout blocks --ssd-block-tokens 32]

The tally goes to benchmarks/results/crash_loop-<timestamp>.json (--out DIR).

Each round starts the server on the same cache directory, checks what the
startup scan left (no *.tmp survives, every file is a complete valid snapshot
with 0600/0700 permissions, the index holds every file; with blocks, every
manifest names only blocks on disk and loads verified), replays requests
whose RAM-tier answers were recorded before earlier kills, then drives
conversations and kills the process with SIGKILL: right after a reply (the
write-behind is in flight), in the middle of a flush, or at a random moment.

Conversations are text completions (the prompt grows by each reply and a
new question), so the harness knows every prompt's exact token ids (the same
tokenizer as the server) and checks durability at the token level, apart
from the chat template's re-tokenization.

Promises checked after every restart:
- every request completed before a flush that reported durable is still
  restorable: some file on disk covers its prompt's first len - 1 tokens.
  A flush promises the checkpoints in *its* process's RAM: a request counts
  only if the flushing process served it (or replayed it). A request served
  by a process killed before its flush may be lost (write-behind), and a
  later process's flush does not bring it back;
- a replayed request restored at least as far as its RAM hit produces the
  tokens the RAM tier produced (temperature 0, one request at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import ServeProc  # noqa: E402

import mlxd  # noqa: E402, F401  (preloads OpenBLAS before mlx)
from mlxd.kv import block_store as bs  # noqa: E402
from mlxd.kv import file_format as ff  # noqa: E402
from mlxd.kv.ssd_store import StoreIdentity  # noqa: E402

TOPICS = ["caches", "rivers", "compilers", "gardens", "trains", "violins", "glaciers", "bees"]
QUESTIONS = ["Why?", "Tell me more.", "Give an example.", "And then?", "Is that all?", "Summarize."]
MAX_TURNS = 6


@attrs.define
class Record:
    """A request whose RAM-tier answer we know (the reply to an exact replay)."""

    conversation: int
    prompt: str
    ids: tuple[int, ...]
    cached_tokens: int
    text: str
    process: int  # the server process (restart number) whose RAM holds its checkpoint
    durable: bool = False  # a flush of that process reported durable after it completed
    lost_to_a_crash: bool = False  # a later process flushed before it was durable (not promised)


@attrs.define
class Conversation:
    number: int
    prompt: str
    turns: int = 0


@attrs.define
class Tally:
    kills: int = 0
    kill_modes: dict[str, int] = attrs.Factory(dict)
    restarts: int = 0
    requests: int = 0
    interrupted_requests: int = 0
    flushes_durable: int = 0
    flushes_interrupted: int = 0
    promised_checked: int = 0
    replays: int = 0
    restores_equal: int = 0
    served_shorter: int = 0  # restore-or-recompute chose RAM/prefill over a longer SSD file
    not_promised_after_crash: int = 0  # records whose process was killed before a durable flush
    lost_unpromised: int = 0
    files_checked: int = 0
    manifests_checked: int = 0  # the blocks layout's checkpoints
    blocks_checked: int = 0
    orphans_reaped: int = 0
    corrupt_removed: int = 0
    max_files: int = 0
    failures: list[str] = attrs.Factory(list)
    seconds: float = 0.0


class Killed(Exception):
    """The server went away under a request (we killed it)."""


class CrashLoop:
    def __init__(self, model_dir: Path, workdir: Path, *, seed: int = 0, max_tokens: int = 8,
                 checks_per_round: int = 3, serve_args: tuple[str, ...] = ()) -> None:
        self.model_dir = Path(model_dir)
        self.cache = Path(workdir) / "ssd"
        self.log_path = Path(workdir) / "serve.log"
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.checks_per_round = checks_per_round
        self.records: list[Record] = []
        self.tokenizer = _tokenizer(self.model_dir)
        self.conversations: list[Conversation] = []
        self.tally = Tally()
        self.proc = ServeProc(["--model", str(self.model_dir), "--model-name", "tiny",
                               "--ssd-cache", str(self.cache), *serve_args], self.log_path)

    # --- the loop ------------------------------------------------------------------

    def run(self, kills: int, *, time_limit: float = float("inf"), progress: bool = False) -> Tally:
        t0 = time.monotonic()
        try:
            while self.tally.kills < kills and time.monotonic() - t0 < time_limit:
                self.round()
                if progress and self.tally.kills % 10 == 0:
                    print(f"kills={self.tally.kills} failures={len(self.tally.failures)} "
                          f"records={len(self.records)} files={self.tally.max_files}", file=sys.stderr, flush=True)
        finally:
            self.proc.kill() if self.proc.proc is not None else None
            self.tally.seconds = round(time.monotonic() - t0, 1)
        return self.tally

    def round(self) -> None:
        self.proc.start()
        self.tally.restarts += 1
        with httpx.Client(base_url=self.proc.url, timeout=60) as http:
            files = self.check_scan(http)
            self.check_durable(files)
            self.check_replays(http)
            self.drive_and_kill(http)

    # --- after a restart -------------------------------------------------------------

    def check_scan(self, http: httpx.Client) -> list[tuple[int, ...]]:
        log = self.proc.log()
        self.tally.orphans_reaped += _count(log, r'"removed_orphans": (\d+)')
        corrupt = _count(log, r'"removed_corrupt": (\d+)')
        self.tally.corrupt_removed += corrupt
        if corrupt:
            self.fail(f"the scan found {corrupt} corrupt files after a SIGKILL")
        tmp = list(self.cache.rglob("*.tmp"))
        if tmp:
            self.fail(f"tmp files survived the scan: {tmp[:3]}")
        files = sorted(self.cache.rglob("*" + ff.EXTENSION))
        for path in files:
            self.check_file(path)
        manifests = sorted(self.cache.rglob("*" + bs.MANIFEST_EXT))
        covered = [ff.read_header(p).tokens for p in files]
        for path in manifests:
            covered += self.check_manifest(path)
        self.tally.files_checked += len(files)
        self.tally.manifests_checked += len(manifests)
        self.tally.max_files = max(self.tally.max_files, len(files) + len(manifests))
        indexed = http.get("/stats").json()["ssd_cache"]["entries"]
        if indexed != len(files) + len(manifests):
            self.fail(f"the index holds {indexed} entries but {len(files)} files and {len(manifests)} "
                      "manifests are on disk")
        return covered

    def check_file(self, path: Path) -> None:
        try:
            ff.read_snapshot(path, verify=True)
        except ff.SnapshotError as exc:
            self.fail(f"{path.name} is not a valid snapshot after the scan: {exc}")
        if stat.S_IMODE(path.stat().st_mode) != 0o600:
            self.fail(f"{path} has mode {oct(path.stat().st_mode)}")
        for d in (path.parent, path.parent.parent):
            if stat.S_IMODE(d.stat().st_mode) != 0o700:
                self.fail(f"{d} has mode {oct(d.stat().st_mode)}")

    def check_manifest(self, path: Path) -> list[tuple[int, ...]]:
        """A committed manifest names only whole blocks on disk and loads verified (exact CRC-32s)."""
        try:
            m = bs.read_manifest(path)
        except ff.StorageError as exc:
            self.fail(f"{path.name} is not a valid manifest after the scan: {exc}")
            return []
        store = bs.BlockStore(self.cache, StoreIdentity(m.meta.model_id, m.meta.config_fingerprint,
                                                         m.meta.tokenizer_hash), block_tokens=m.block_tokens)
        for b in m.blocks:
            block = store.block_path(b.name)
            if not block.exists():
                self.fail(f"{path.name} names a missing block {b.name}")
                return []
            if stat.S_IMODE(block.stat().st_mode) != 0o600:
                self.fail(f"{block} has mode {oct(block.stat().st_mode)}")
        record = store.read_record(path)
        if record is None or store.load(record, verify=True) is None:
            self.fail(f"{path.name} does not load verified after the scan")
            return []
        self.tally.blocks_checked += len(m.blocks)
        return [m.tokens]

    def check_durable(self, files: list[tuple[int, ...]]) -> None:
        """Every prefix a flush reported durable is covered by a file (all KV here is trimmable)."""
        for record in self.records:
            if not record.durable:
                continue
            self.tally.promised_checked += 1
            need = len(record.ids) - 1
            have = max((_common_prefix(record.ids, tokens) for tokens in files), default=0)
            if have < need:
                self.fail(f"a durable prefix was lost: files cover {have} of {need} tokens", record.prompt)

    def check_replays(self, http: httpx.Client) -> None:
        """Replay a few recorded requests (one per conversation): restores equal the RAM tier."""
        durable = {r.conversation: r for r in self.records if r.durable}
        recent = {r.conversation: r for r in self.records[-2:]}
        picks = self.rng.sample(sorted(durable.values(), key=lambda r: r.conversation),
                                min(self.checks_per_round, len(durable)))
        picks += [r for c, r in recent.items() if c not in {p.conversation for p in picks}]
        for record in picks:
            reply = self.complete(http, record.prompt)
            self.tally.replays += 1
            record.process = self.tally.restarts  # its checkpoint is in this process's RAM again
            usage = reply["usage"]
            if usage["prompt_tokens"] != len(record.ids):
                self.fail(f"the server tokenized a prompt to {usage['prompt_tokens']} ids, we to {len(record.ids)}")
                continue
            if usage["prompt_tokens_details"]["cached_tokens"] < record.cached_tokens:
                if record.durable:
                    self.tally.served_shorter += 1
                else:
                    self.tally.lost_unpromised += 1
                continue
            text = reply["choices"][0]["text"]
            if text != record.text:
                self.fail(f"a restore diverged from the RAM tier: {text!r} != {record.text!r}", record.prompt)
            else:
                self.tally.restores_equal += 1

    # --- driving and killing -------------------------------------------------------

    def drive_and_kill(self, http: httpx.Client) -> None:
        if self.tally.restarts == 1:  # start from some durable state, so every run has promises to keep
            self.turn(http)
            self.flush(http)
        mode = self.rng.choice(["after_reply", "after_reply", "during_flush", "random", "random"])
        self.tally.kill_modes[mode] = self.tally.kill_modes.get(mode, 0) + 1
        try:
            if mode == "after_reply":
                for _ in range(self.rng.randint(1, 3)):
                    self.turn(http)
                    if self.rng.random() < 0.3:
                        self.flush(http)
                self.kill_after(self.rng.uniform(0, 0.03))
            elif mode == "during_flush":
                self.turn(http)
                self.kill_after(self.rng.uniform(0, 0.05))
                self.flush(http)
            else:
                self.kill_after(self.rng.uniform(0.05, 1.5))
                while True:
                    self.turn(http) if self.rng.random() < 0.75 else self.flush(http)
        except Killed:
            pass
        self.proc.wait(30)
        self.tally.kills += 1

    def kill_after(self, delay: float) -> None:
        pid = self.proc.pid
        timer = threading.Timer(delay, lambda: _sigkill(pid))
        timer.daemon = True
        timer.start()
        if delay < 0.1:
            timer.join()  # the kill lands right after the last reply

    def turn(self, http: httpx.Client) -> None:
        convo = self.pick_conversation()
        question = self.rng.choice(QUESTIONS) + f" ({self.rng.randint(0, 99)})"
        prompt = f"{convo.prompt}\nUser: {question}\nAssistant:"
        first = self.complete(http, prompt)
        replay = self.complete(http, prompt)  # the RAM tier's answer to an exact repeat
        self.records.append(Record(
            convo.number, prompt, tuple(self.tokenizer.encode(prompt)),
            replay["usage"]["prompt_tokens_details"]["cached_tokens"], replay["choices"][0]["text"],
            self.tally.restarts,
        ))
        convo.prompt = prompt + first["choices"][0]["text"]
        convo.turns += 1

    def pick_conversation(self) -> Conversation:
        self.conversations = [c for c in self.conversations if c.turns < MAX_TURNS]
        if len(self.conversations) < 3:
            n = self.tally.requests + len(self.records)
            topic = self.rng.choice(TOPICS)
            system = f"Conversation {n}. You are an expert on {topic}. Answer in one calm sentence. " * 10
            self.conversations.append(Conversation(n, system))
        return self.rng.choice(self.conversations)

    def flush(self, http: httpx.Client) -> None:
        done = len(self.records)
        try:
            r = http.post("/admin/cache/flush")
        except httpx.TransportError:
            self.tally.flushes_interrupted += 1
            raise Killed from None
        if r.status_code == 200 and r.json()["durable"]:
            self.tally.flushes_durable += 1
            for record in self.records[:done]:
                if record.durable:
                    continue
                if record.process == self.tally.restarts:
                    record.durable = True
                elif not record.lost_to_a_crash:  # its process was killed before a flush: not promised
                    record.lost_to_a_crash = True
                    self.tally.not_promised_after_crash += 1

    def complete(self, http: httpx.Client, prompt: str) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": self.max_tokens}
        try:
            r = http.post("/v1/completions", json=body)
        except httpx.TransportError:
            self.tally.interrupted_requests += 1
            raise Killed from None
        self.tally.requests += 1
        if r.status_code != 200:
            self.fail(f"a request failed: {r.status_code} {r.text[:200]}")
            raise Killed
        return r.json()

    def fail(self, message: str, prompt: str | None = None) -> None:
        self.tally.failures.append(f"round {self.tally.restarts}: {message}")
        print("FAIL", message, file=sys.stderr, flush=True)
        if prompt is not None:  # keep the prompt for a post-mortem
            self.log_path.with_name(f"failure-{len(self.tally.failures)}.txt").write_text(prompt)


def _tokenizer(model_dir: Path) -> Any:
    """The server's tokenizer (mlx-lm's wrapper over tokenizer.json), for exact prompt ids."""
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(model_dir)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _count(log: str, pattern: str) -> int:
    return sum(int(m) for m in re.findall(pattern, log))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--model", type=Path, help="model dir (default: build the 'test' preset)")
    p.add_argument("--workdir", type=Path, help="where the cache and log go (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=3600.0, help="stop after this many seconds")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="directory for the result JSON")
    p.add_argument("--ssd-layout", choices=("whole", "blocks"), help="the server's --ssd-layout (default: its own)")
    p.add_argument("--ssd-block-tokens", type=int, help="the server's --ssd-block-tokens (blocks)")
    args = p.parse_args()
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mlxd-crash-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from mlxd.model.tiny import build_model

        model = build_model(workdir / "model", "test", seed=0)
    serve_args = (*(("--ssd-layout", args.ssd_layout) if args.ssd_layout else ()),
                  *(("--ssd-block-tokens", str(args.ssd_block_tokens)) if args.ssd_block_tokens else ()))
    tally = CrashLoop(model, workdir, seed=args.seed, serve_args=serve_args).run(
        args.kills, time_limit=args.time_limit, progress=True)
    out = {"command": " ".join(["python", "benchmarks/crash_loop.py", *sys.argv[1:]]), "started": started,
           "kills_asked": args.kills, "seed": args.seed, "tally": attrs.asdict(tally)}
    print(json.dumps(out, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"crash_loop-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 1 if tally.failures or tally.kills < args.kills else 0


if __name__ == "__main__":
    sys.exit(main())
