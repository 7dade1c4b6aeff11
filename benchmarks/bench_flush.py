"""SIGTERM flush speed (issue 28): a warm server's unwritten backlog flushed on SIGTERM, ÷ the disk's raw write rate.

    python benchmarks/bench_flush.py --small --rounds 3                       # CPU, the bench preset
    python benchmarks/bench_flush.py --small --arm before=/path/to/old/src --arm after=src
    python3 benchmarks/bench_flush.py --preset qwen3-1.7b --out $OUT         # the H200 (../shared/GPU.md)

Per round and arm: a fresh `mlxd serve --ssd-cache DIR` gets N conversations at once
(a distinct `--prompt-tokens` prompt each, max_tokens 1) while write-behind is held to
a crawl (`--ssd-write-rate 0.01` MB/s while the engine is busy), so nearly every
checkpoint is still unwritten when the last reply ends. The client then sums the
finished cache files on disk and sends SIGTERM at once; the flush window runs from
there to the server's `serve.flushed` log line (the same wall clock), and the bytes
are the finished files after exit less those before. The raw rate is a plain file
of the same size written in 8 MiB pieces and fsynced, in the same directory, in the
same round. Reported per arm: the medians of flush MB/s, raw MB/s and their ratio.
An arm runs `mlxd serve` with its own source tree first on PYTHONPATH (before/after
a change on one machine, side by side).

`--beside-decode`: one more request decodes (streamed, end tokens banned) from before
the conversations until just before the signal, so their checkpoints' writes begin
beside decode (one block at a time, at the crawl), as write-behind's do in serving;
the client closes it, then signals.

Where a flush's seconds went (per round, and medians per arm): from the server's log,
`signal_s` (SIGTERM to `serve.shutdown`), `drain_s` (to `serve.drained`), `flush_s`
(to `serve.flushed`), `close_s` (to `serve.stopped`, the runtime closed) and `exit_s`
(to the process's exit, seen by the client); from the flush's report, the writes that
finished during it and their thread-seconds: `stage_s` (copies to host memory, CUDA),
`pwrite_s`, `sync_s` (write-backs and fsyncs), `files_s` (open to rename).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "gpu"))

from bench_host_tier_servers import raw_write_s  # noqa: E402
from serve_proc import ServeProc  # noqa: E402

RESULTS = HERE / "results"


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def build_model(preset: str, dest: Path) -> Path:
    """The bench presets as `mlxd build-model`; qwen3-1.7b / qwen3-8b in bf16 as the GPU drivers build them."""
    if (dest / "config.json").exists():
        return dest  # built by an earlier run (--work)
    if preset.startswith("qwen3-"):
        from bench_gpu import QWEN3_1_7B, QWEN3_8B, build

        return build(QWEN3_1_7B if preset == "qwen3-1.7b" else QWEN3_8B, dest)
    from mlxd.model.tiny import build_model as build_tiny

    return build_tiny(dest, preset, seed=0)


def cache_file_bytes(directory: Path) -> int:
    """Bytes of finished cache files (tmp files are writes in flight)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            if not name.endswith(".tmp"):
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except FileNotFoundError:
                    pass
    return total


def raw_write_mb_s(directory: Path, nbytes: int) -> float:
    """Write `nbytes` in 8 MiB pieces and fsync: the disk's plain sequential write rate, MB/s."""
    return nbytes / raw_write_s(directory, nbytes) / 1e6


def log_events(text: str, *events: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if any(f'"{e}"' in line for e in events):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def decode_beside(url: str, model: str, stop: threading.Event, started: threading.Event) -> None:
    """One streamed request decoding (end tokens banned) until `stop` is set; then the client closes it."""
    import httpx

    body = {"model": model, "prompt": "Count on and on. " * 8, "max_tokens": 1_000_000, "stream": True,
            "temperature": 0.0, "logit_bias": {"0": -100, "2": -100}}  # <|endoftext|>, <|im_end|> (built-in)
    try:
        with httpx.Client(base_url=url, timeout=None) as h, h.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    return  # closing the stream ends the row
    except httpx.HTTPError as exc:
        log("decode beside:", exc)
    finally:
        started.set()


def timeline(text: str, t_term: float, t_exit: float) -> dict[str, float | None]:
    """Seconds from SIGTERM to each shutdown step the server logged, as differences (None: not logged)."""
    at: dict[str, float | None] = {}
    for key, event in (("shutdown", "serve.shutdown"), ("drained", "serve.drained"), ("flushed", "serve.flushed"),
                       ("stopped", "serve.stopped")):
        lines = log_events(text, event)
        at[key] = (datetime.fromisoformat(lines[-1]["timestamp"].replace("Z", "+00:00")).timestamp()
                   if lines else None)
    steps = [("signal_s", t_term, at["shutdown"]), ("drain_s", at["shutdown"], at["drained"]),
             ("flush_s", at["drained"], at["flushed"]), ("close_s", at["flushed"], at["stopped"]),
             ("exit_s", at["stopped"] or at["flushed"], t_exit)]
    return {name: round(b - a, 4) if a is not None and b is not None else None for name, a, b in steps}


SPLIT = ("writes", "written_bytes", "stage_s", "pwrite_s", "sync_s", "files_s")


async def warm(url: str, model: str, prompts: list[str]) -> None:
    import httpx

    async def one(client: httpx.AsyncClient, text: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                "temperature": 0.0}
        resp = await client.post(url + "/v1/chat/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {resp.text[:500]}")

    async with httpx.AsyncClient(timeout=None) as client:
        await asyncio.gather(*(one(client, p) for p in prompts))


def one_round(arm: str, src: str | None, model_dir: Path, prompts: list[str], work: Path, args: argparse.Namespace,
              r: int) -> dict[str, Any]:
    import httpx

    ssd = work / f"ssd-{arm}-{r}"
    shutil.rmtree(ssd, ignore_errors=True)
    ssd.mkdir(parents=True)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)} if src else None
    serve_args = ["--model", str(model_dir), "--ssd-cache", str(ssd), "--ssd-write-rate", "0.01",
                  "--prompt-cache-gb", str(args.prompt_cache_gb), "--shutdown-timeout", str(args.shutdown_timeout),
                  "--ssd-demote-idle", "0", "--queue-timeout", "0", "--max-batch", str(max(4, len(prompts))), *args.serve_args]
    proc = ServeProc(serve_args, work / f"{arm}-{r}.log", env=env)
    proc.start(timeout=600)
    row: dict[str, Any] = {"arm": arm, "round": r}
    stop, started = threading.Event(), threading.Event()
    beside = threading.Thread(target=decode_beside, args=(proc.url, model_dir.name, stop, started), daemon=True)
    try:
        asyncio.run(warm(proc.url, model_dir.name, ["warm up " * 20]))  # measures the prompt rate
        if args.beside_decode:
            beside.start()
            started.wait(60)
        t0 = time.perf_counter()
        asyncio.run(warm(proc.url, model_dir.name, prompts))
        row["warm_s"] = round(time.perf_counter() - t0, 3)
        if args.beside_decode:
            stop.set()
            beside.join(30)
            while httpx.get(proc.url + "/stats", timeout=30).json()["scheduler"]["running"]:
                time.sleep(0.01)  # the closed stream's row has left the batch
        stats = httpx.get(proc.url + "/stats", timeout=30).json()
        ssd_stats = stats["ssd_cache"]
        row["pending_spill_bytes"] = ssd_stats["pending_spill_bytes"]
        row["pending_spills"] = ssd_stats["pending_spills"]
        before = cache_file_bytes(ssd)
        t_term = time.time()
        proc.signal(signal.SIGTERM)
        row["exit_code"] = proc.wait(timeout=args.shutdown_timeout + 60)
        t_exit = time.time()
    finally:
        stop.set()
        proc.kill()
    text = proc.log()
    row["timeline"] = timeline(text, t_term, t_exit)
    flushed = log_events(text, "serve.flushed")
    after = cache_file_bytes(ssd)
    row["bytes_before"], row["bytes_after"] = before, after
    row["flushed_bytes"] = after - before
    if flushed:
        end = datetime.fromisoformat(flushed[-1]["timestamp"].replace("Z", "+00:00")).timestamp()
        row["flush_window_s"] = round(end - t_term, 4)
        row["report"] = {k: flushed[-1].get(k) for k in ("durable", "pending", "failed", "entries", "seconds", *SPLIT)}
        row["flush_MB_s"] = row["flushed_bytes"] / max(row["flush_window_s"], 1e-6) / 1e6
    else:
        row["error"] = "no serve.flushed line: " + text[-2000:]
    row["raw_write_MB_s"] = raw_write_mb_s(work, max(after - before, 64 << 20))
    if "flush_MB_s" in row:
        row["flush_over_raw"] = row["flush_MB_s"] / row["raw_write_MB_s"]
    shutil.rmtree(ssd, ignore_errors=True)
    log(arm, r, json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
    return row


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the CPU preset: --preset bench, 2048-token prompts")
    ap.add_argument("--preset", default=None, help="bench, default, qwen3-1.7b or qwen3-8b (default qwen3-1.7b; "
                    "--small: bench)")
    ap.add_argument("--conversations", type=int, default=None, help="conversations warmed at once (default 8; "
                    "--small 6)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="tokens per prompt (default 16384; --small 2048)")
    ap.add_argument("--prompt-cache-gb", type=float, default=None, help="RAM tier cap (default 40; --small 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shutdown-timeout", type=float, default=240.0)
    ap.add_argument("--beside-decode", action="store_true",
                    help="a request decodes while the conversations are sent, closed just before the signal")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=SRC",
                    help="an arm: NAME, serving from source tree SRC (repeatable; default one arm, this tree)")
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="more `mlxd serve` flags (last)")
    ap.add_argument("--work", type=Path, default=None, help="scratch dir (kept; a model built there is reused)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", RESULTS)))
    args = ap.parse_args()
    preset = args.preset or ("bench" if args.small else "qwen3-1.7b")
    n_conv = args.conversations or (6 if args.small else 8)
    n_tok = args.prompt_tokens or (2048 if args.small else 16384)
    if args.prompt_cache_gb is None:
        args.prompt_cache_gb = 2.0 if args.small else 40.0
    arms = [(a.split("=", 1)[0], str(Path(a.split("=", 1)[1]).resolve())) for a in args.arm] or [("current", None)]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-flush-"))
    work.mkdir(parents=True, exist_ok=True)
    # The GPU drivers' naming, so a model built by bench_host_tier_servers.py under the same --work is reused.
    model_dir = build_model(preset, work / f"model-{preset}{'-shape' if preset.startswith('qwen3-') else ''}")
    from bench_serving import TextMaker

    maker = TextMaker(model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    res = args.out / f"flush-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out: dict[str, Any] = {"argv": sys.argv, "preset": preset, "conversations": n_conv, "prompt_tokens": n_tok,
                           "arms": {name: src for name, src in arms}, "rows": []}
    for r in range(args.rounds):
        prompts = [maker.make(9000 + 100 * r + i, n_tok) for i in range(n_conv)]
        order = arms if r % 2 == 0 else arms[::-1]
        for name, src in order:
            try:
                out["rows"].append(one_round(name, src, model_dir, prompts, work, args, r))
            except Exception as exc:  # keep what was measured
                out["rows"].append({"arm": name, "round": r, "error": f"{type(exc).__name__}: {exc}"})
                log(name, r, "failed", exc)
            res.write_text(json.dumps(out, indent=1))
    summary: dict[str, Any] = {}
    for name, _ in arms:
        rows = [x for x in out["rows"] if x["arm"] == name and "flush_MB_s" in x]
        summary[name] = {
            "flush_MB_s": median([x["flush_MB_s"] for x in rows]),
            "raw_write_MB_s": median([x["raw_write_MB_s"] for x in rows]),
            "flush_over_raw": median([x["flush_over_raw"] for x in rows]),
            "flush_window_s": median([x["flush_window_s"] for x in rows]),
            "flushed_MB": median([x["flushed_bytes"] / 1e6 for x in rows]),
            "rounds": len(rows),
            # where the seconds went: the shutdown's steps, and the flush's writes (thread-seconds)
            "timeline": {k: median([x["timeline"][k] for x in rows if x["timeline"].get(k) is not None])
                         for k in ("signal_s", "drain_s", "flush_s", "close_s", "exit_s")},
            "writer": {k: median([x["report"][k] for x in rows if x["report"].get(k) is not None]) for k in SPLIT},
        }
    if len(arms) == 2:  # per-round ratio of the two arms' flush rates
        a, b = arms[0][0], arms[1][0]
        per = [x["flush_MB_s"] / y["flush_MB_s"] for x in out["rows"] for y in out["rows"]
               if x["arm"] == b and y["arm"] == a and x["round"] == y["round"] and "flush_MB_s" in x
               and "flush_MB_s" in y]
        summary[f"{b}_over_{a}_flush_MB_s"] = median(per)
    out["summary"] = summary
    res.write_text(json.dumps(out, indent=1))
    log("summary", json.dumps(summary))
    log("->", res)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
