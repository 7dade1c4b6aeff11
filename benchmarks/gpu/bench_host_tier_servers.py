"""Issue 28's server goals in one bounded run: mlxd (host tier / RAM only / host + SSD) vs mlx_lm.server.

    # on the CUDA host (../shared/GPU.md), or here on the CPU with --small:
    python3 benchmarks/gpu/bench_host_tier_servers.py --out $OUT [--small] [--servers mlx_lm,mlxd_host_ssd]

Each server gets the same conversations (`--prompt-tokens` first prompts, 16k by
default, on the 1.7B shape): A cold, A again (RAM hit), A's next turn (prefix hit
+ ~30 new tokens), then B and C cold, which push A out of a RAM tier sized for
about one conversation (`--prompt-cache-gb 3`), then A's third turn (the returning
conversation: back from the host tier, a recompute without one; `mlxd_host` keeps
A's pages on the device while its memory budget has room, a reclaim, and
`mlxd_host_tight` runs under `--tight-budget-gb` so they leave HBM and come back
by a promotion). Then decode: a fresh
long prompt (its checkpoint is what write-behind writes next), at once 1 stream and
then 8 streams of `--decode-tokens` tokens (EOS banned), tok/s from the streamed
tokens' arrival times; with `--rounds 0` (decode only; `--decode-schedule interleaved`) with every server
still up, in many short rounds that each visit every server at each level in an order
balanced for position and for who runs after whom (plus mlx_lm again: the control), each run with its own fresh prompt, the SSD
servers' pending writes settled before each run, and the ratios to mlx_lm taken per
round (median + IQR: benchmarks/gpu/interleave.py), `--budget` seconds in all; `serial`
is the old order (each server's levels in its own turn). mlx_lm.server keeps every prompt in device memory. The host +
SSD server is then restarted on its SSD tier and A's third turn sent again (restore
or recompute, as its advisor chooses), then restarted twice more with
`--restore-choice always` and `never` (the two arms) for the ratio to min(restore,
recompute); `--restart-cycles N` runs the three N times in turn (the host's drift on every arm). Each restart reports its advisor's choice, the arms it predicted, the
startup probe's restore bandwidth and the served one (`restarts` in the summary).
`--streams ""` skips decode; `--rounds 0` is decode only (no TTFT rounds, no restarts); `--servers mlxd_host_ssd` alone measures the restarts' goal.

To fit one device call: the model is built once under `--work` and reused, every
server starts at once (measured one at a time, each stopped after its turn), and the
JSON is saved after every measurement (and on SIGTERM, with the servers' log tails).
The printed summary holds the issue's ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import mlx.core as mx  # noqa: E402
from bench_gpu import QWEN3_1_7B, Proc, built, done_lines, log, text_of, ttft  # noqa: E402

import mlxd  # noqa: E402, F401
from mlxd.model import presets  # noqa: E402

EOS_BAN = {"0": -100, "2": -100}  # <|endoftext|>, <|im_end|> of the built-in tokenizer
TEXTS = {"q2": "Say more about the last part, briefly.", "q3": "And how does that compare with the start?"}


def median(xs: list[float]) -> float:
    s = sorted(x for x in xs if x == x)
    return s[len(s) // 2] if s else float("nan")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b and a == a and b == b else None


async def decode(base: str, model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Streams at once; tok/s per stream after its first token, and all together over the shared span."""
    import httpx

    sent: list[float] = []

    async def one(client: httpx.AsyncClient, prompt: str) -> list[float]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True, "logit_bias": EOS_BAN}
        times: list[float] = []
        sent.append(time.perf_counter())  # (all eight are sent before any reply: gather starts each in turn)
        last = ""  # the stream's last event: what a reply without tokens said instead (H100 07:24, every server)
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
            if resp.status_code >= 400:  # the server's own words (mlx_lm.server answers 404 when generate raises)
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:400]!r}")
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = line[6:]
                    for ch in json.loads(last).get("choices") or []:
                        if (ch.get("delta") or {}).get("content"):
                            times.append(time.perf_counter())
        if not times:
            raise RuntimeError(f"no tokens; the last event: {last[:400]}")
        return times

    async with httpx.AsyncClient(timeout=None) as client:
        streams = await asyncio.gather(*(one(client, p) for p in prompts))
    per = [(len(t) - 1) / (t[-1] - t[0]) for t in streams if len(t) > 1 and t[-1] > t[0]]
    # All rows decoding: from the last stream's first token to the first stream's last one.
    start, end = max(t[0] for t in streams if t), min(t[-1] for t in streams if t)
    inside = sum(sum(start <= x <= end for x in t) for t in streams)
    # The whole decode: every token after each stream's first, from the first token any stream got to the last
    # (defined when the server does not run every row at once: mlx_lm at 8 streams of 64 tokens, H200 21:07).
    first, last = min(t[0] for t in streams if t), max(t[-1] for t in streams if t)
    after_first = sum(len(t) - 1 for t in streams if t)
    return {"streams": len(prompts), "tokens": [len(t) for t in streams], "per_stream_tok_s": per,
            "tok_s": (inside - len(streams)) / (end - start) if end > start else None,
            "span_tok_s": after_first / (last - first) if last > first else None,
            "first_token_spread_s": round(start - first, 4), **stream_timing(streams, min(sent))}


TIMING_KEYS = ("first_ms", "last_ms", "slow_gaps", "ttft_ms")  # what a decode run keeps of `stream_timing`


def stream_timing(streams: list[list[float]], sent: float | None = None) -> dict[str, Any]:
    """Where each stream's time went, from the run's first token (ms): its first and last token, and its slow
    gaps (at least 3x its median gap and 5 ms over it) as [the token after the gap, ms]: a stall at the start of a
    decode (before the last stream's first token) lowers a stream's own rate but not the rate while all rows
    decode; one at the end lowers both. With `sent` (when the first request went out): each stream's first token
    after it (`ttft_ms`, the client's time to first token at this level of concurrency)."""
    timed = [t for t in streams if t]
    if not timed:
        return {}
    zero = min(t[0] for t in timed)
    ttft = {"ttft_ms": [round((t[0] - sent) * 1e3, 1) for t in timed]} if sent is not None else {}
    slow = []
    for t in timed:
        gaps = [b - a for a, b in itertools.pairwise(t)]
        typical = median(gaps) if gaps else 0.0
        slow.append([[i + 1, round(g * 1e3, 1)] for i, g in enumerate(gaps) if g >= 3 * typical and g - typical >= 5e-3])
    return {"first_ms": [round((t[0] - zero) * 1e3, 1) for t in timed],
            "last_ms": [round((t[-1] - zero) * 1e3, 1) for t in timed], "slow_gaps": slow, **ttft}


def run_server(s: Proc, model: str, prompts: list[list[str]], args: argparse.Namespace, fresh: list[str],
               out: dict[str, Any], save: Any) -> None:
    rows: list[dict[str, Any]] = out.setdefault("rows", [])
    asyncio.run(ttft(s.base, model, "warm up " * 20))
    for a, b, c in prompts:
        row: dict[str, Any] = {}
        rows.append(row)
        hist = [{"role": "user", "content": a}]
        row["cold"] = asyncio.run(ttft(s.base, model, hist))
        row["hit"] = asyncio.run(ttft(s.base, model, hist))
        hist += [{"role": "assistant", "content": row["hit"]["text"]}, {"role": "user", "content": TEXTS["q2"]}]
        row["next"] = asyncio.run(ttft(s.base, model, hist))
        hist += [{"role": "assistant", "content": row["next"]["text"]}, {"role": "user", "content": TEXTS["q3"]}]
        save()
        # --restart-only: the restarts need A's checkpoints on disk, not B and C pushing A out of RAM
        # --next-only: the next turn's goal alone (no B and C, no returning turn)
        row["others"] = [] if args.restart_only or args.next_only else [
            asyncio.run(ttft(s.base, model, p)) for p in (b, c)]
        if not args.next_only:
            row["returning"] = asyncio.run(ttft(s.base, model, hist))  # A returns after B and C
        if s.name.startswith("mlxd"):  # the event loop's stalls so far (MLXD_STALL_WATCH_MS), the last 8 with frames
            import httpx  # and the garbage collections so far (each long one with the thread it stopped)

            stats = httpx.get(s.base + "/stats", timeout=30).json()
            row["event_loop"], row["gc"] = stats.get("event_loop"), stats.get("gc")
            row["host_copies"] = ((stats.get("cache") or {}).get("host") or {}).get("copies")  # the moves so far
        row["history"] = hist
        save()
        log(s.name, " ".join(f"{k} {row[k]['ttft_s']:.3f}s/{row[k]['cached_tokens']}" for k in
                             ("cold", "hit", "next", "returning") if k in row))
    for i, n in enumerate(args.streams if args.decode_schedule == "serial" else []):  # else decode_interleaved
        # A fresh long prompt first: on the SSD server, its checkpoint is being written while these decode.
        asyncio.run(ttft(s.base, model, fresh[i]))
        d = asyncio.run(decode(s.base, model, [f"Story {j}: " + TEXTS["q2"] for j in range(n)], args.decode_tokens))
        runs = out.setdefault("decode_runs", {}).setdefault(str(n), [])  # `--streams 1,8,1,8`: each level twice
        runs.append(d)
        out.setdefault("decode", {})[str(n)] = {**d, "tok_s": median([r["tok_s"] for r in runs if r["tok_s"]]),
                                                "runs": len(runs)}
        save()
        log(s.name, f"decode {n} streams: {d['tok_s']}")
    if s.name.startswith("mlxd"):
        import httpx

        stats = httpx.get(s.base + "/stats", timeout=30).json()
        out["stats"] = {k: stats.get(k) for k in ("cache", "ssd_cache", "host_cache", "event_loop", "gc") if k in stats}


def model_of(name: str, model_dir: Path) -> str:
    """The model name a server answers to."""
    return "default_model" if name == "mlx_lm" else model_dir.name


def ttft_interleaved(procs: dict[str, Proc], model_dir: Path, args: argparse.Namespace, out: dict[str, Any],
                     save: Any, deadline: float | None) -> None:
    """A RAM hit and the next turn with every server up: `--ttft-rounds` rounds (fewer where `deadline` comes
    first), each visiting every server (interleave.slots, as the decode rounds) plus the reference's control.
    Each run: a fresh prompt of `--ttft-tokens` tokens (cold), the same again (the hit), and a next turn (the
    hit's reply and a question). TTFT in seconds, ratios per round to the reference (below 1: faster), median
    + IQR, in out["ttft_interleaved"]. Servers that run one after another (the TTFT rows above) drift apart by
    more than a few milliseconds (the H100 at 09:29 / 09:35 2026-12-07: the first token early ÷ late unreadable)."""
    import interleave

    names = list(procs)
    ref = "mlx_lm" if "mlx_lm" in names else names[0]
    schedule = "interleaved" if args.decode_schedule == "serial" else args.decode_schedule
    runs: list[interleave.Run] = []
    rec: dict[str, Any] = {"schedule": schedule, "reference": ref, "prompt_tokens": args.ttft_tokens, "runs": []}
    out["ttft_interleaved"] = rec
    for name in names:  # each server's first hit and next turn outside the rounds
        text = text_of(model_dir, args.ttft_tokens, 7000)
        asyncio.run(ttft(procs[name].base, model_of(name, model_dir), text))
    seed, longest = 8000, 0.0
    for r in range(args.ttft_rounds):
        t_round = time.perf_counter()
        if r and deadline is not None and t_round + longest > deadline:
            rec["stopped"] = f"budget: {r} rounds (the next would end past it)"
            break
        for at, slot in enumerate(interleave.slots(names, ref, r, schedule)):
            name = interleave.server_of(slot)
            base, model = procs[name].base, model_of(name, model_dir)
            run: dict[str, Any] = {"round": r, "at": at, "slot": slot}
            try:
                hist = [{"role": "user", "content": text_of(model_dir, args.ttft_tokens, seed)}]
                run["cold"] = asyncio.run(ttft(base, model, hist))["ttft_s"]
                hit = asyncio.run(ttft(base, model, hist))
                run["hit"], run["hit_cached"] = hit["ttft_s"], hit["cached_tokens"]
                hist += [{"role": "assistant", "content": hit["text"]}, {"role": "user", "content": TEXTS["q2"]}]
                nxt = asyncio.run(ttft(base, model, hist))
                run["next"], run["next_cached"] = nxt["ttft_s"], nxt["cached_tokens"]
            except Exception as exc:  # one failed run: its ratios are None, the rounds go on
                run["error"] = f"{type(exc).__name__}: {exc}"
            seed += 1
            rec["runs"].append(run)
            for kind in ("hit", "next"):
                runs.append(interleave.Run(r, kind, at, slot, run.get(kind)))
        rec["summary"] = interleave.summarize(runs, ref, schedule)
        rec["rounds_done"] = r + 1
        longest = max(longest, time.perf_counter() - t_round)
        log("ttft", f"round {r}", " ".join(f"{x['slot']} hit {x.get('hit')} next {x.get('next')}"
                                           for x in rec["runs"] if x["round"] == r))
        save()
    import httpx

    for name in names:  # each mlxd server's memory after the rounds (the budget, MLX's cache, CUDA's pool)
        if name.startswith("mlxd"):
            try:
                rec.setdefault("memory", {})[name] = (httpx.get(procs[name].base + "/stats", timeout=30).json()
                                                      .get("cache") or {}).get("memory")
            except (httpx.HTTPError, ValueError) as exc:
                rec.setdefault("memory", {})[name] = {"error": f"{type(exc).__name__}: {exc}"}
    save()
    for kind in ("hit", "next"):
        level = (rec.get("summary") or {}).get("levels", {}).get(kind, {})
        log("ttft", f"{kind}, TTFT ÷ {ref} (median [IQR] over {level.get('rounds')} rounds)", json.dumps(
            {slot: [e.get("median"), e.get("iqr")] for slot, e in level.get("ratio_to_" + ref, {}).items()}))


def decode_interleaved(procs: dict[str, Proc], model_dir: Path, args: argparse.Namespace, out: dict[str, Any],
                       save: Any, deadline: float | None) -> None:
    """Decode levels with every server up: `--decode-rounds` rounds (fewer where `deadline`, perf_counter,
    comes first: a round starts only if the longest round so far still fits), each visiting every server at
    each level (interleave.slots: a Williams design's orders, or bracketed by the reference) plus the reference's control slot.
    Each run: a fresh prompt (on an SSD server its write-behind runs during the decode, as in the serial
    schedule), then the level's streams. Before each run, the SSD servers' pending writes settle (at most
    `--settle-s`), so one server's write-behind never falls into another's decode. Results in
    out["decode_interleaved"] (runs, per-round ratios, median + IQR) and, per server, out[name]["decode"]
    (median tok/s) and ["decode_runs"] (in round order)."""
    import interleave

    names = list(procs)
    ref = "mlx_lm" if "mlx_lm" in names else names[0]
    levels = list(dict.fromkeys(args.streams))
    ssd = [procs[n].base for n in names if "ssd" in n]
    runs: list[interleave.Run] = []
    rec: dict[str, Any] = {"schedule": args.decode_schedule, "reference": ref, "levels": levels,
                           "metric": args.decode_metric,
                           "decode_tokens": args.decode_tokens, "prompt_tokens": args.fresh_tokens,
                           "stream_tokens": args.stream_tokens, "runs": []}
    out["decode_interleaved"] = rec

    def streams(n: int, seed: int | None = None) -> list[str]:
        if args.stream_tokens and seed is not None:  # long rows of their own, fresh each run: their ends' final
            # checkpoints (with the SSD tier, write plans of the whole row) fall beside the other rows' decode
            return [text_of(model_dir, args.stream_tokens, seed + j) for j in range(n)]
        return [f"Story {j}: " + TEXTS["q2"] for j in range(n)]

    if args.decode_warmup_tokens:  # each server's first decode at each level outside the rounds
        for n in levels:
            for name in names:
                asyncio.run(decode(procs[name].base, model_of(name, model_dir), streams(n), args.decode_warmup_tokens))
    maker_seed = 5000  # a fresh prompt per run: no server ever hits a prompt another run sent it
    stream_seed = 200_000  # --stream-tokens: fresh stream prompts per run too
    longest = 0.0
    for r in range(args.decode_rounds):
        t_round = time.perf_counter()
        if r and deadline is not None and t_round + longest > deadline:
            rec["stopped"] = f"budget: {r} rounds (the next would end past it)"
            break
        for n in levels:
            order = interleave.slots(names, ref, r, args.decode_schedule)
            texts = [text_of(model_dir, args.fresh_tokens, maker_seed + i) for i in range(len(order))]
            maker_seed += len(order)
            for at, (slot, text) in enumerate(zip(order, texts, strict=True)):
                name = interleave.server_of(slot)
                base, model = procs[name].base, model_of(name, model_dir)
                settled = settle(ssd, args.settle_s)
                run: dict[str, Any] = {"round": r, "streams": n, "at": at, "slot": slot, "settle_s": settled}
                try:
                    run["prompt_ttft_s"] = asyncio.run(ttft(base, model, text))["ttft_s"]
                    counts = writer_counts(base) if base in ssd else None
                    before = counts.get("bytes_written") if counts is not None else None
                    gc_before = gc_so_far(base) if name.startswith("mlxd") else None
                    d = asyncio.run(decode(base, model, streams(n, stream_seed), args.decode_tokens))
                    stream_seed += n
                    gc_after = gc_so_far(base) if gc_before is not None else None
                    if gc_before is not None and gc_after is not None:  # collections inside this decode
                        run.update(gc_ms=round((gc_after[0] - gc_before[0]) * 1e3, 2),
                                   gc_full=gc_after[1] - gc_before[1])
                    if before is not None:  # what write-behind wrote beside this decode (the goal's condition),
                        # and after it (a write the server deferred past the decode: held or paced while rows ran)
                        after = writer_counts(base)
                        run.update(written_mb(before, after.get("bytes_written") if after else None, "beside"))
                        run["writer_beside"] = counts_beside(counts, after)  # the writer's work in the window
                        run["write_after_decode_s"] = settle([base], args.settle_s)
                        run.update(written_mb(before, writer_bytes(base), "by_settle"))
                    rates = {"span_tok_s": d["span_tok_s"], "all_rows_tok_s": d["tok_s"],
                             "stream_sum_tok_s": sum(d["per_stream_tok_s"]) or None,
                             "median_stream_tok_s": median_stream({"per_stream_tok_s": d["per_stream_tok_s"]}),
                             "client_sum_tok_s": client_sum(d)}
                    run.update(tok_s=rates[args.decode_metric], **rates, per_stream_tok_s=d["per_stream_tok_s"],
                               tokens=d["tokens"], first_token_spread_s=d["first_token_spread_s"],
                               **{k: d[k] for k in TIMING_KEYS if k in d})
                except Exception as exc:  # one failed run: its ratios are None, the rounds go on
                    run.update(tok_s=None, error=f"{type(exc).__name__}: {exc}")
                rec["runs"].append(run)
                runs.append(interleave.Run(r, n, at, slot, run["tok_s"]))
                if slot in names:
                    out[name].setdefault("decode_runs", {}).setdefault(str(n), []).append(run)
            rec["summary"] = interleave.summarize(runs, ref, args.decode_schedule)
            level = rec["summary"]["levels"][str(n)]["ratio_to_" + ref]
            writes = [(x.get("mb_written_beside"), x.get("mb_written_by_settle"),
                       round(((x.get("writer_beside") or {}).get("staged_bytes") or 0) / 1e6, 1))
                      for x in rec["runs"][-len(order):] if "mb_written_beside" in x]
            log("decode", f"round {r} {n} streams", " ".join(
                f"{slot} {entry['values'][-1]}" for slot, entry in level.items()),
                f"SSD MB written beside its decode / by the write's end / staged beside {writes}",
                f"({time.perf_counter() - t_round:.1f} s)")
        longest = max(longest, time.perf_counter() - t_round)
        rec["rounds_done"] = r + 1
        gone = failing_servers(rec["runs"], r)
        if gone:  # no ratio can come of the rounds left (the H100 at 09:30 2026-12-07: 38 rounds of 404s)
            rec["stopped"] = f"every run of {', '.join(gone)} failed in rounds {r - 1} and {r}"
            log("decode", "stopped:", rec["stopped"])
        for name in names:
            for n in levels:
                rates = [x["tok_s"] for x in out[name].get("decode_runs", {}).get(str(n), []) if x["tok_s"]]
                out[name].setdefault("decode", {})[str(n)] = {"tok_s": median(rates) if rates else None,
                                                               "runs": len(rates)}
        save()
        if gone:
            break
    for name in names:  # each mlxd server's tiers, writer and engine after the rounds (where its entries went)
        if name.startswith("mlxd"):
            try:
                import httpx

                stats = httpx.get(procs[name].base + "/stats", timeout=30).json()
                out[name]["stats_after_decode"] = {k: stats.get(k) for k in ("cache", "ssd_cache", "host_cache",
                                                                             "engine", "gc") if k in stats}
            except (httpx.HTTPError, ValueError) as exc:
                out[name]["stats_after_decode"] = {"error": f"{type(exc).__name__}: {exc}"}
    save()
    for name in names:  # a fresh prompt last, so the stop's flush has a backlog as after the serial schedule
        if "ssd" in name:
            asyncio.run(ttft(procs[name].base, model_of(name, model_dir),
                             text_of(model_dir, args.fresh_tokens, maker_seed)))
    summary = rec.get("summary") or {}
    for n, level in (summary.get("levels") or {}).items():
        log("decode", f"{n} streams, ratio to {ref} (median [IQR] over {level['rounds']} rounds, "
            f"{args.decode_metric})", json.dumps(
            {slot: [e["median"], e["iqr"]] for slot, e in level["ratio_to_" + ref].items()}))
    for n, medians in by_metric(rec).items():
        log("decode", f"{n} streams, median ratio to {ref} by metric", json.dumps(medians))
    rec["stalls"] = stalls(rec["runs"])
    for n, per_slot in rec["stalls"].items():
        log("decode", f"{n} streams, own rate / all-rows rate and slow gaps per slot", json.dumps(per_slot))
    rec["writer_beside"] = writer_summary(rec["runs"])
    for n, per_slot in rec["writer_beside"].items():
        log("decode", f"{n} streams, the SSD writer beside each decode (median [min-max] per slot)", json.dumps(per_slot))


def writer_summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per level and SSD slot, each `writer_beside` counter's median, min and max over its runs (MB for bytes):
    what write-behind did inside the decodes (held, urgent and why, handed out beside prefills)."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for run in runs:
        beside = run.get("writer_beside")
        if not beside:
            continue
        slot = out.setdefault(str(run["streams"]), {}).setdefault(run["slot"], {})
        for key, value in beside.items():
            slot.setdefault(key, []).append(value / 1e6 if "bytes" in key else value)
    return {n: {slot: {(k.replace("bytes", "mb") if "bytes" in k else k):
                       [round(median(v), 3), round(min(v), 3), round(max(v), 3)] for k, v in counts.items()}
                for slot, counts in per.items()} for n, per in out.items()}


def stalls(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per level and slot, over its runs: the median of the streams' summed own rates over the rate while all
    rows decoded (below 1: time lost before the last stream's first token or after the first stream's last,
    where one stream waits and the all-rows window does not), and, where the runs recorded them
    (`stream_timing`), the slow gaps: per run their ms summed over streams, and which tokens they came before; and the
    streams' times to first token, medians over runs (`ttft_ms`: a run's median stream's, `last_ttft_ms`: its slowest's)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for x in runs:
        if x.get("tok_s") is None:
            continue
        slot = out.setdefault(str(x["streams"]), {}).setdefault(x["slot"], {"runs": 0, "own_over_all_rows": [],
                                                                             "slow_ms": [], "at_token": [],
                                                                             "ttft": [], "last_ttft": []})
        slot["runs"] += 1
        if x.get("all_rows_tok_s") and x.get("stream_sum_tok_s"):
            slot["own_over_all_rows"].append(x["stream_sum_tok_s"] / x["all_rows_tok_s"])
        if "slow_gaps" in x:
            slot["slow_ms"].append(sum(ms for gaps in x["slow_gaps"] for _, ms in gaps))
            slot["at_token"].extend(i for gaps in x["slow_gaps"] for i, _ in gaps)
        if x.get("ttft_ms"):
            slot["ttft"].append(median(x["ttft_ms"]))
            slot["last_ttft"].append(max(x["ttft_ms"]))
    for level in out.values():
        for slot in level.values():
            ttft, last = slot.pop("ttft"), slot.pop("last_ttft")
            if ttft:  # a run's median stream's time to first token, and its slowest stream's (median over runs)
                slot.update(ttft_ms=round(median(ttft), 1), last_ttft_ms=round(median(last), 1))
            own, slow, at = slot.pop("own_over_all_rows"), slot.pop("slow_ms"), slot.pop("at_token")
            slot["own_over_all_rows"] = round(median(own), 4) if own else None  # (None: never all rows at once)
            if slow:
                slot.update(slow_ms_per_run=round(median(slow), 1),
                            at_token={str(i): at.count(i) for i in sorted(set(at))})
    return out


DECODE_METRICS = ("stream_sum_tok_s", "span_tok_s", "all_rows_tok_s", "median_stream_tok_s", "client_sum_tok_s")


def median_stream(run: dict[str, Any]) -> float | None:
    """A run's median stream's own rate (first to last token): a batched row's rate, which a server that admits
    its 8th row alone a second late (mlx_lm.server: at 1.2-2x the others' rate, H100 2026-12-06) does not
    lift. Computed from `per_stream_tok_s` for runs recorded before it was a metric."""
    rates = [x for x in run.get("per_stream_tok_s") or [] if x]
    return statistics.median(rates) if rates else None


def client_sum(run: dict[str, Any]) -> float | None:
    """Each request's tokens over its whole wait, from the request sent to its last token, added up: the rate each
    client got, its wait for a first token included (a server that keeps one client waiting until the others end,
    then serves it alone, is not credited that lone row's rate, as `stream_sum_tok_s` credits it). From `ttft_ms`
    (the first request sent to each stream's first token) and `first_ms` / `last_ms`; runs recorded before `ttft_ms`
    are read from the run's first token (the first token's common wait left out)."""
    tokens, first, last = run.get("tokens"), run.get("first_ms"), run.get("last_ms")
    if not (tokens and first and last):
        return None
    waited = run.get("ttft_ms") or first
    rates = [n / ((w + b - a) / 1e3) for n, w, a, b in zip(tokens, waited, first, last, strict=False) if w + b - a > 0]
    return sum(rates) or None


def metric_of(run: dict[str, Any], metric: str) -> float | None:
    if metric not in run and metric == "median_stream_tok_s":
        return median_stream(run)
    if metric not in run and metric == "client_sum_tok_s":
        return client_sum(run)
    return run.get(metric)


def by_metric(rec: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per level, each slot's median per-round ratio under each decode metric (`--decode-metric`), so a
    conclusion that hangs on the metric shows."""
    import interleave

    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for metric in DECODE_METRICS:
        runs = [interleave.Run(x["round"], x["streams"], x["at"], x["slot"], metric_of(x, metric)) for x in rec["runs"]]
        for n, level in interleave.summarize(runs, rec["reference"], rec["schedule"])["levels"].items():
            for slot, entry in level["ratio_to_" + rec["reference"]].items():
                out.setdefault(n, {}).setdefault(slot, {})[metric] = entry["median"]
    return out


def written_mb(before: int | None, after: int | None, label: str) -> dict[str, float | None]:
    return {f"mb_written_{label}": round((after - before) / 1e6, 1) if before is not None and after is not None
            else None}


# The SSD writer's counters (`/stats` ssd_cache.writer) a decode run reports the change of: what write-behind did
# inside the decode's window (bytes of finished writes, bytes staged to host memory and in how many pieces and
# copy calls, slices handed to the OS, pieces that waited for an engine step, seconds staging and held).
WRITER_COUNTS = ("bytes_written", "staged_bytes", "staged_pieces", "staged_calls", "step_waits", "stage_s", "held_s")


def writer_counts(base: str) -> dict[str, float] | None:
    """The server's SSD writer counters so far (`WRITER_COUNTS`; from `pacing`: `bytes_out`, `prefill_bytes_out`
    and each urgency reason's seconds as `urgent_s.<reason>`)."""
    import httpx

    try:
        writer = (httpx.get(base + "/stats", timeout=30).json().get("ssd_cache") or {}).get("writer") or {}
    except (httpx.HTTPError, ValueError):
        return None
    counts = {k: writer[k] for k in WRITER_COUNTS if isinstance(writer.get(k), (int, float))}
    pacing = writer.get("pacing") or {}
    for key in ("bytes_out", "prefill_bytes_out"):  # (the second: bytes written while a request awaited its first
        if isinstance(pacing.get(key), (int, float)):  # token; older servers have none)
            counts[key] = pacing[key]
    for reason, seconds in (pacing.get("urgent_s") or {}).items():  # why write-behind was not paced or held
        counts[f"urgent_s.{reason}"] = seconds
    return counts


def writer_bytes(base: str) -> int | None:
    """Bytes the server's SSD writer has written so far (`/stats` ssd_cache.writer.bytes_written)."""
    counts = writer_counts(base)
    return None if counts is None else counts.get("bytes_written")  # type: ignore[return-value]


def counts_beside(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """What the writer's counters gained between two readings (None where either failed)."""
    if before is None or after is None:
        return None
    return {k: round(after[k] - before.get(k, 0), 4) for k in after  # a reason first urgent in between: from 0
            if k in before or k.startswith("urgent_s.")}


def gc_so_far(base: str) -> tuple[float, int] | None:
    """The server's garbage collections so far: (seconds paused, full collections), from `/stats` gc."""
    import httpx

    try:
        gc = httpx.get(base + "/stats", timeout=30).json().get("gc") or {}
    except (httpx.HTTPError, ValueError):
        return None
    return (sum(gc["paused_s"]), gc["collections"][2]) if gc.get("paused_s") else None


def settle(bases: list[str], limit_s: float) -> float | None:
    """Wait until no server in `bases` has a write pending (`/stats` ssd_cache.pending_spills), at most
    `limit_s`; the seconds waited (None: still pending at the limit, or /stats failed)."""
    import httpx

    t0 = time.perf_counter()
    left = list(bases)
    while left:
        try:
            left = [b for b in left if (httpx.get(b + "/stats", timeout=30).json().get("ssd_cache") or {}).get(
                "pending_spills")]
        except (httpx.HTTPError, ValueError):
            return None
        if not left:
            break
        if time.perf_counter() - t0 > limit_s:
            return None
        time.sleep(0.05)
    return round(time.perf_counter() - t0, 3)



def _moved(cmd: list[str], port: int, offset: int) -> tuple[list[str], int]:
    """A server's command and port with its `--port` moved by `offset`."""
    moved = [str(port + offset) if i and cmd[i - 1] == "--port" and a == str(port) else a for i, a in enumerate(cmd)]
    return moved, port + offset


def _ssd_caps(cmds: dict[str, tuple[list[str], int]], wanted: list[str], args: argparse.Namespace) -> float | None:
    """Give each wanted server with an SSD tier an `--ssd-cache-max` (GB, in place; None when uncapped): the
    server's own LRU then deletes old files where an uncapped tier would run the disk out of space."""
    ssd = [w for w in wanted if "--ssd-cache" in cmds[w][0]]
    if not ssd or args.ssd_cap_gb == 0:
        return None
    cap = args.ssd_cap_gb or max(4.0, round(shutil.disk_usage(args.work).free / 2 / len(ssd) / 1e9, 1))
    for w in ssd:
        cmds[w][0].extend(["--ssd-cache-max", f"{cap:g}"])
    return cap


def main() -> int:
    # mlxd's event-loop stalls of 20 ms or more, with what each thread ran then, in every turn's report
    # (a request that waits before the server reads it shows on no server-side clock: runtime/stall_watch.py)
    os.environ.setdefault("MLXD_STALL_WATCH_MS", "20")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the bench preset and small sizes (CPU)")
    ap.add_argument("--no-share", action="store_true",
                    help="no --memory-budget share per mlxd server on a GPU (each keeps its default budget)")
    ap.add_argument("--preset", default=None,
                    help="model preset (default: the 1.7B shape; --small: bench); `test` makes decode host-bound on the CPU")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/host-servers")))
    ap.add_argument("--port-offset", type=int, default=0,
                    help="added to every server's port (another run of this script on the same host)")
    ap.add_argument("--ssd-cap-gb", type=float, default=None,
                    help="each SSD server's --ssd-cache-max (default: half the work disk's free space at the start, "
                         "shared by the SSD servers run, at least 4 GB; 0 = uncapped: long runs of several SSD "
                         "servers fill a 64 GiB disk)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/host-servers-work"),
                    help="scratch dir; a model built there is reused (default /tmp/host-servers-work)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ssd-block-tokens", type=int, default=0,
                    help="the SSD servers' --ssd-block-tokens (0: theirs; --small's 512-token prompts fit one "
                         "default block, which leaves an overlapped split no boundary)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="first-prompt tokens (default 16384; --small 512)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="tokens per decode stream (default 128; --small 24)")
    ap.add_argument("--stream-tokens", type=int, default=0,
                    help="interleaved decode: each stream's prompt a fresh text of this many tokens (0: a short "
                         "question, 26 tokens on the 1.7B shape), so rows that end hold long KV")
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",") if x.strip()], default=[1, 8],
                    help="decode concurrency levels (default 1,8; empty: no decode; serial schedule: a level "
                         "given again is measured again and its tok/s is the median)")
    ap.add_argument("--decode-schedule", choices=("auto", "interleaved", "bracket", "serial"), default="auto",
                    help="auto: interleaved with `--rounds 0` (decode only), else serial; "
                         "interleaved: after the TTFT rounds every server stays up and `--decode-rounds` short "
                         "rounds each visit every server at each level (orders balanced for position and neighbour), plus a control slot "
                         "(mlx_lm again); ratios per round, median + IQR (benchmarks/gpu/interleave.py); "
                         "bracket: each server between two mlx_lm runs; serial: each server's levels in its own "
                         "turn, one server after another (before 21:00 UTC 2026-12-04)")
    ap.add_argument("--decode-metric", choices=DECODE_METRICS, default="client_sum_tok_s",
                    help="interleaved/bracket: the tok/s the ratios use (every one is recorded per run): "
                         "client_sum_tok_s (the default since 2026-12-07 18:00, issue 28's decode goal), each "
                         "request's tokens over its whole wait (sent to last token) added up: what the clients got, a "
                         "late first token included; stream_sum_tok_s (before), each stream's own rate (first to last "
                         "token) added up, which credits a server that keeps one client waiting until the others end "
                         "(mlx_lm.server's 8th stream, ~1 s) that client's lone-row rate; span_tok_s, every "
                         "token after each stream's first over the first to the last token of any stream (the "
                         "admission's stagger counts); all_rows_tok_s, only while every row decodes (the serial "
                         "schedule's tok/s; None where they never all did, and inflated by bursty delivery); "
                         "median_stream_tok_s, the median stream's own rate (a batched row's: a lone late row's "
                         "higher rate does not lift it)")
    ap.add_argument("--ttft-rounds", type=int, default=0,
                    help="with every server up, before the decode rounds: this many rounds of a fresh prompt, its "
                         "RAM hit and its next turn on each server in turn (interleaved; ratios per round to "
                         "mlx_lm, or to the first server; `--budget` may end them first; 0: none)")
    ap.add_argument("--ttft-tokens", type=int, default=4096, help="the prompt of each --ttft-rounds run")
    ap.add_argument("--decode-rounds", type=int, default=8,
                    help="interleaved/bracket: rounds at most (`--budget` usually ends them first)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds from the start for everything up to the last decode round: a round starts only if "
                         "the longest one so far still fits (the stops, flush and summary come after; 0: no limit)")
    ap.add_argument("--settle-s", type=float, default=10,
                    help="interleaved/bracket: before each run, wait at most this long for the SSD servers' pending "
                         "writes (one server's write-behind never falls into another's decode)")
    ap.add_argument("--decode-warmup-tokens", type=int, default=16,
                    help="interleaved/bracket: each server decodes this many tokens at each level before the rounds "
                         "(0: none)")
    ap.add_argument("--servers", default="mlx_lm,mlxd_host,mlxd_ram,mlxd_host_ssd",
                    help="which to run (mlx_lm, mlxd_host, mlxd_host_tight, mlxd_ram, mlxd_host_ssd, "
                         "mlxd_host_ssd_hold, mlxd_host_ssd_noprobe, mlxd_host_ssd_lateplan, mlxd_host_ssd_packed, "
                         "mlxd_host_ssd_lateplan_packed, mlxd_ram_withtoken, mlxd_host_ssd_withtoken, mlxd_ram_mlxfilter, mlxd_host_ssd_planmain, mlxd_host_ssd_hostread, ...); the "
                         "restarts follow mlxd_host_ssd")
    ap.add_argument("--no-restart", action="store_true", help="skip the two restarts of mlxd_host_ssd")
    ap.add_argument("--next-only", action="store_true",
                    help="per round A cold, A again and A's next turn only (no B, C, returning turn): the next turn's "
                         "goal in less time")
    ap.add_argument("--restart-only", action="store_true",
                    help="only what the restarts need: mlxd_host_ssd alone, A's turns without B and C, no decode")
    ap.add_argument("--restart-arms", default=",".join(DEFAULT_ARMS),
                    help=f"which restarts, in order (from {', '.join(RESTARTS)}; restart_always_probe: every "
                         "restore forced, the startup probe on: the probe's effect on serving's restores)")
    ap.add_argument("--restart-cycles", type=int, default=1,
                    help="the restart arms this many times over, in turn, odd cycles in reverse order (restart, "
                         "never, always, always, never, restart, ...): "
                         "the host's drift falls on every arm alike; each arm's median is over all its turns. A "
                         "forced arm leaves the advisor's file as it found it, so each `restart` resumes what the "
                         "advisor arm's own processes measured (a server restarted again and again)")
    ap.add_argument("--restart-page-cache", choices=("keep", "drop"), default="keep",
                    help="before each restart: keep the page cache as the previous server left it (a later arm "
                         "reads what an earlier one read), or drop the SSD files' pages (every arm starts alike; "
                         "the startup's WILLNEED warming still runs)")
    ap.add_argument("--tight-budget-gb", default=None,
                    help="mlxd_host_tight's --memory-budget (default 9 on the 1.7B shape: the weights, the RAM tier "
                         "and one entry's headroom, so B and C push A's pages out of HBM; --small 2)")
    ap.add_argument("--start-timeout", type=float, default=180)
    args = ap.parse_args()
    if args.restart_only:
        args.servers, args.streams, args.no_restart = "mlxd_host_ssd", [], False
    if args.decode_schedule == "auto":
        args.decode_schedule = "interleaved" if args.rounds == 0 else "serial"
    arms = [a for a in args.restart_arms.split(",") if a]
    if args.ssd_cap_gb is not None and not args.ssd_cap_gb >= 0:
        ap.error("--ssd-cap-gb must be >= 0 (0 = uncapped)")
    if [a for a in arms if a not in RESTARTS]:
        ap.error(f"unknown restart arms {[a for a in arms if a not in RESTARTS]}; choose from {list(RESTARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    t_begin = time.perf_counter()
    preset = presets.PRESETS[args.preset] if args.preset else presets.PRESETS["bench"] if args.small else QWEN3_1_7B
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = built(preset, args.work)
    n = args.prompt_tokens or (512 if args.small else 16384)
    args.decode_tokens = args.decode_tokens or (24 if args.small else 128)
    # RAM sized for about 1.5 first prompts, so B and C push A out (KV bytes per token: fp32 on the CPU).
    kv_per_token = preset.num_hidden_layers * preset.num_key_value_heads * preset.head_dim * 2 * (
        4 if mx.default_device() == mx.cpu else 2)
    ram_gb = f"{1.5 * n * kv_per_token / 1e9:.4f}" if args.small else "3"
    host_gb = "1" if args.small else "24"
    prompts = [[text_of(model_dir, n, 700 + 3 * r + i) for i in range(3)] for r in range(args.rounds)]
    args.fresh_tokens = n
    fresh = [text_of(model_dir, n, 900 + i) for i in range(len(args.streams))] if args.decode_schedule == "serial" else []
    ssd_dir = args.work / "ssd"
    for old in args.work.glob("ssd*"):  # every arm's SSD tier: one left from an earlier run fills the disk (H100
        shutil.rmtree(old, ignore_errors=True)  # 2026-12-06 10:25: ssd/ and ssd-hostread/ 17 GB each, ENOSPC)
    base = [sys.executable, "-m", "mlxd.cli", "serve", "--model", str(model_dir), "--log-format", "json",
            "--prompt-cache-gb", ram_gb, "--queue-timeout", "0"]
    ssd = ["--ssd-cache", str(ssd_dir)] + (["--ssd-block-tokens", str(args.ssd_block_tokens)] if args.ssd_block_tokens else [])
    cmds = {
        "mlxd_host": (base + ["--port", "18190", "--host-cache-gb", host_gb, "--device-probe", "off"], 18190),
        "mlxd_ram": (base + ["--port", "18191", "--device-probe", "off"], 18191),
        # RAM only, short prefill chunks over a long context attended without cuDNN's per-shape graph
        # (model/suffix_attention.py): the next turn's suffix
        "mlxd_ram_unfused": (["env", "MLXD_SUFFIX_ATTENTION=unfused", *base, "--port", "18195",
                              "--device-probe", "off"], 18195),
        # RAM only, both default fixes of the next turn off (model/suffix_attention.py, model/batch_handover.py):
        # what mlxd_ram was before they became the default
        "mlxd_ram_plain": (["env", "MLXD_SUFFIX_ATTENTION=off", "MLXD_BATCH_HANDOVER=0", *base, "--port", "18199",
                            "--device-probe", "off"], 18199),
        # RAM only, a short suffix on an idle engine prefilled on its lent caches before it joins
        # (engine/core.py SUFFIX_APART): not by mlx-lm's prompt phase
        "mlxd_ram_apart": (["env", "MLXD_SUFFIX_APART=256", *base, "--port", "18196", "--device-probe", "off"], 18196),
        # RAM only, a lone row's KV into mlx-lm's batch and on to generation uncopied (model/batch_handover.py)
        "mlxd_ram_handover": (["env", "MLXD_BATCH_HANDOVER=1", *base, "--port", "18197", "--device-probe", "off"],
                              18197),
        # RAM only, with mlx-lm's buffer-cache clear after every prompt chunk (MLXD_KEEP_BUFFERS=0,
        # model/keep_buffers.py; mlxd_ram keeps the buffers, the default since 2026-12-07)
        "mlxd_ram_clear": (["env", "MLXD_KEEP_BUFFERS=0", *base, "--port", "18178", "--device-probe", "off"], 18178),
        # RAM only, a lone row's first token handed out with the step after the one that sampled it, as mlx-lm
        # hands it out (MLXD_FIRST_TOKEN_EARLY=0; mlxd_ram hands it out with that step, the default since 2026-12-07)
        "mlxd_ram_late": (["env", "MLXD_FIRST_TOKEN_EARLY=0", *base, "--port", "18177", "--device-probe", "off"],
                          18177),
        # RAM only, CUDA's memory pool left at its peak when idle (MLXD_POOL_TRIM=0; mlxd_ram trims it after a
        # second idle, the default since 2026-12-07 12:00): what the trim costs the next request
        "mlxd_ram_notrim": (["env", "MLXD_POOL_TRIM=0", *base, "--port", "18176", "--device-probe", "off"], 18176),
        # RAM only, every row that ends filtered out of mlx-lm's batch at once (MLXD_CARRY_ROWS=0; mlxd_ram carries
        # it one step while the others decode, model/carry_rows.py, the default since 2026-12-07 15:00)
        "mlxd_ram_filter": (["env", "MLXD_CARRY_ROWS=0", *base, "--port", "18175", "--device-probe", "off"], 18175),
        # RAM only, rows joining decoding rows handed their first token with the step that sampled it too
        # (MLXD_JOIN_FIRST_EARLY=1; mlxd_ram: only rows that joined no decoding row, mlx-lm's timing for the rest)
        "mlxd_ram_joinearly": (["env", "MLXD_JOIN_FIRST_EARLY=1", *base, "--port", "18174", "--device-probe", "off"],
                               18174),
        # both of the last two
        "mlxd_ram_both": (["env", "MLXD_BATCH_HANDOVER=1", "MLXD_SUFFIX_APART=256", *base, "--port", "18198",
                           "--device-probe", "off"], 18198),
        # The host tier with HBM short: the returning conversation's pages really left the device (a promotion),
        # where mlxd_host's idle server keeps them there while the budget has room (a reclaim, no copy).
        "mlxd_host_tight": (base + ["--port", "18194", "--host-cache-gb", host_gb, "--device-probe", "off",
                                    "--memory-budget", args.tight_budget_gb or ("2" if args.small else "9")], 18194),
        "mlxd_host_ssd": (base + ["--port", "18192", "--host-cache-gb", host_gb, *ssd], 18192),
        # The same without the start-up probe (mlxd_ram's and mlxd_host's is off): what the probe leaves behind
        # (its tuned prefill chunk, its cost model, the memory it used), told apart from what the tiers cost decode
        "mlxd_host_ssd_noprobe": (base + ["--port", "18187", "--host-cache-gb", host_gb, "--ssd-cache",
                                          str(args.work / "ssd-noprobe"), "--device-probe", "off"], 18187),
        # The same with each finished row's final checkpoint (its write plan) taken in the step after its last
        # token, its finish held until then (engine/core.py `_leave_late`; issue 28: eight rows ending together)
        "mlxd_host_ssd_lateplan": (["env", "MLXD_FINAL_PLAN=after-token", *base, "--port", "18186", "--host-cache-gb",
                                    host_gb, "--ssd-cache", str(args.work / "ssd-lateplan")], 18186),
        # The same with each write plan of up to 64 MB made from one packed copy of its tensors (engine/features.py
        # `plan_pack_bytes`): one host conversion per checkpoint instead of one per tensor (issue 28: a final
        # checkpoint has 56 tensors on the 1.7B shape, eight rows ending together convert 448 in their last step);
        # with the default final plan since 2026-12-06 (after-forward) what mlxd_host_ssd_lateforward_packed was
        "mlxd_host_ssd_packed": (["env", "MLXD_PLAN_PACK_MB=64", *base, "--port", "18185", "--host-cache-gb",
                                  host_gb, "--ssd-cache", str(args.work / "ssd-packed")], 18185),
        # Both: the final plans a step late and every plan of up to 64 MB packed (H100 03:40/03:44 2026-12-06: the
        # late plans took the SSD server's end-of-decode stall out of the streams, packing halved the plans' time)
        "mlxd_host_ssd_lateplan_packed": (["env", "MLXD_FINAL_PLAN=after-token", "MLXD_PLAN_PACK_MB=64", *base,
                                           "--port", "18184", "--host-cache-gb", host_gb, "--ssd-cache",
                                           str(args.work / "ssd-lateplan-packed")], 18184),
        # The final checkpoints in the step of the last token (MLXD_FINAL_PLAN=with-token: the default before
        # 2026-12-06, now after-forward): their KV copies wait for the forward in flight, and every row's next
        # token with them (H100 04:31-05:07 2026-12-06: ~30 ms in each step where rows ended, RAM only too)
        "mlxd_ram_withtoken": (["env", "MLXD_FINAL_PLAN=with-token", *base, "--port", "18183",
                                "--device-probe", "off"], 18183),
        # rows leave the batch by mlx-lm's own filter, which waits for the forward in flight (MLXD_BATCH_FILTER)
        "mlxd_ram_mlxfilter": (["env", "MLXD_BATCH_FILTER=0", *base, "--port", "18181", "--device-probe", "off"], 18181),
        # the write plans' slices on the generation stream, behind the forward in flight (MLXD_PLAN_STREAM=main)
        "mlxd_host_ssd_planmain": (["env", "MLXD_PLAN_STREAM=main", *base, "--port", "18180", "--host-cache-gb", host_gb,
                                    "--ssd-cache", str(args.work / "ssd-planmain")], 18180),
        # the write plans' buffers host views, whose first read converts each row's KV to managed memory with the
        # GIL held (MLXD_PLAN_DEVICE=0; the default hands the writer device addresses, staged by DMA)
        "mlxd_host_ssd_hostread": (["env", "MLXD_PLAN_DEVICE=0", *base, "--port", "18179", "--host-cache-gb", host_gb,
                                    "--ssd-cache", str(args.work / "ssd-hostread")], 18179),
        "mlxd_host_ssd_withtoken": (["env", "MLXD_FINAL_PLAN=with-token", *base, "--port", "18182",
                                     "--host-cache-gb", host_gb, "--ssd-cache", str(args.work / "ssd-withtoken")],
                                    18182),
        # The same with every fresh prompt's checkpoint written at full speed beside the decode after it (a backlog
        # bound under one 8k prompt of the 1.7B shape: urgent at once, as every wbgaps level was at 20:23; issue 28)
        "mlxd_host_ssd_urgent": (base + ["--port", "18189", "--host-cache-gb", host_gb, "--ssd-cache",
                                         str(args.work / "ssd-urgent"), "--ssd-backlog-gb", "0.5"], 18189),
        # The same with write-behind's full-speed slices through the page cache (MLXD_SSD_DIRECT=0: the default
        # before 2026-12-07 21:30, when they became O_DIRECT too): the fresh prompt's checkpoint is being written and
        # written back as the decode starts (issue 28: the SSD server's start later at 8 streams)
        "mlxd_host_ssd_buffered": (["env", "MLXD_SSD_DIRECT=0", *base, "--port", "18173", "--host-cache-gb", host_gb,
                                    "--ssd-cache", str(args.work / "ssd-buffered")], 18173),
        # The same with write-behind held still while rows decode (issue 28: decode beside write-behind).
        "mlxd_host_ssd_hold": (base + ["--port", "18188", "--host-cache-gb", host_gb, "--ssd-cache",
                                       str(args.work / "ssd-hold"), "--ssd-write-hold-decode"], 18188),
        "mlx_lm": ([sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", "18193",
                    "--log-level", "WARNING"], 18193),
    }
    if args.port_offset:  # beside another run of this script on the same host (their fixed ports would collide)
        cmds = {k: _moved(cmd, port, args.port_offset) for k, (cmd, port) in cmds.items()}
    wanted = [w for w in args.servers.split(",") if w]
    unknown = [w for w in wanted if w not in cmds]
    if unknown:
        ap.error(f"unknown servers {unknown}; choose from {sorted(cmds)}")
    wanted.sort(key=lambda w: w == "mlxd_host_ssd")  # last: its stop flushes, and the restarts follow it
    share = shared_budget_gb(len(wanted), args)
    for name in wanted:  # servers up at once share the GPU: each mlxd keeps to its share (one left alone, none)
        cmd = cmds[name][0]
        if share is not None and name.startswith("mlxd") and "--memory-budget" not in cmd:
            cmds[name] = (cmd + ["--memory-budget", share], cmds[name][1])
    ssd_cap_gb = _ssd_caps(cmds, wanted, args)
    out: dict[str, Any] = {"device": str(mx.default_device()), "tokens": n, "rounds": args.rounds,
                           "decode_tokens": args.decode_tokens, "argv": sys.argv, "restart_arms": arms,
                           "restart_page_cache": args.restart_page_cache, "ssd_cap_gb": ssd_cap_gb,
                           "commands": {k: " ".join(v[0]) for k, v in cmds.items() if k in wanted}}
    kind = ("small-" if args.small else "") + ("restart-" if args.restart_only else "")
    res = args.out / f"host_servers-{kind}{time.strftime('%Y%m%d-%H%M%S')}.json"
    logs = {name: args.work / f"{name}.log" for name in [*wanted, *RESTARTS]}
    for p in logs.values():
        p.unlink(missing_ok=True)
    lock = threading.Lock()

    def save() -> None:
        out["elapsed_s"] = round(time.perf_counter() - t_begin, 1)
        with lock:
            tmp = res.with_suffix(".tmp")
            tmp.write_text(json.dumps(out, indent=1, default=str))
            tmp.replace(res)

    def keep_logs() -> None:  # each server log's tail, and its first error (a tail shows only the last ones)
        for name, path in logs.items():
            if path.exists():
                text = path.read_text(errors="replace")
                out.setdefault("log_tails", {})[name] = text[-4000:]
                first = first_error(text)
                if first:
                    out.setdefault("log_first_errors", {})[name] = first

    def stop(*_: Any) -> None:  # `timeout` sends SIGTERM: keep what was measured, with the server logs' tails
        keep_logs()
        try:  # the goals of what was measured (a restart cut short: its arm is missing)
            out["summary"] = summarize(out, wanted)
            print_stages(out["summary"])
        except Exception as exc:
            out["summary_error"] = repr(exc)
        save()
        raise SystemExit(124)

    signal.signal(signal.SIGTERM, stop)
    out["build_s"] = round(time.perf_counter() - t_begin, 1)

    # Every server starts at once; each is measured alone, then stopped.
    procs = {name: Proc(name, cmds[name][0], cmds[name][1], "/v1/models" if name == "mlx_lm" else "/health",
                        logs[name]) for name in wanted}
    started: dict[str, Any] = {}

    def start(name: str) -> None:
        try:
            started[name] = procs[name].start(timeout=args.start_timeout)
        except Exception as exc:
            started[name] = exc

    threads = [threading.Thread(target=start, args=(name,)) for name in wanted]
    for t in threads:
        t.start()
    # Each server's GPU memory every few seconds (the H100 at 09:33 2026-12-07: all three servers on one GPU
    # died of "an illegal memory access", mlx_lm.server first; what each held then was not on record).
    threading.Thread(target=sample_gpu_memory, args=(procs, out.setdefault("gpu_memory_mib", [])),
                     daemon=True).start()
    stoppers: list[threading.Thread] = []

    def finish(name: str) -> None:
        s, entry = procs[name], out[name]
        before = dir_bytes(ssd_dir) if name == "mlxd_host_ssd" else 0
        t0 = time.perf_counter()
        entry["exit_code"] = s.stop()
        entry["stop_s"] = round(time.perf_counter() - t0, 2)
        if name.startswith("mlxd"):
            entry["log"] = done_lines(logs[name])
            entry["flushed"] = [x for x in _json_lines(logs[name]) if x.get("event") == "serve.flushed"]
        if name == "mlxd_host_ssd" and entry["flushed"]:
            entry["flush"] = flush_report(entry["flushed"][-1], dir_bytes(ssd_dir) - before, ssd_dir)
            log(name, "flush", json.dumps(entry["flush"]))
        save()

    def stop_server(name: str) -> None:
        if name == "mlxd_host_ssd":
            finish(name)  # the restarts need its directory, flushed
        else:
            stoppers.append(threading.Thread(target=finish, args=(name,)))
            stoppers[-1].start()
        save()

    # Decode interleaved across the servers: each keeps running after its TTFT rounds, all stop after the decode.
    interleave = (bool(args.streams) and args.decode_schedule != "serial") or args.ttft_rounds > 0
    up: list[str] = []
    for name, t in zip(wanted, threads, strict=True):
        t.join()
        entry = out.setdefault(name, {})
        entry["start_s"] = started[name] if not isinstance(started[name], Exception) else None
        try:
            if isinstance(started[name], Exception):
                raise started[name]
            run_server(procs[name], model_of(name, model_dir), prompts, args, fresh, entry, save)
            up.append(name)
        except Exception as exc:  # keep what was measured
            out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            log(name, "failed", exc)
        finally:
            if not (interleave and name in up):
                stop_server(name)
    if interleave and up:
        deadline = t_begin + args.budget if args.budget else None
        try:
            if args.ttft_rounds > 0:
                ttft_interleaved({name: procs[name] for name in up}, model_dir, args, out, save, deadline)
            if args.streams and args.decode_schedule != "serial":
                decode_interleaved({name: procs[name] for name in up}, model_dir, args, out, save, deadline)
        except Exception as exc:  # keep what was measured
            out["decode_interleaved_error"] = f"{type(exc).__name__}: {exc}"
            log("decode_interleaved", "failed", exc)
        finally:
            for name in up:  # in `wanted`'s order: mlxd_host_ssd last
                stop_server(name)
    for t in stoppers:
        t.join()

    rows_ssd = out.get("mlxd_host_ssd", {}).get("rows") or []
    if rows_ssd and not args.no_restart:
        cmd = cmds["mlxd_host_ssd"][0]
        for cycle in range(args.restart_cycles):
            # Odd cycles run the arms in reverse: over two cycles each arm is first once and last once (the
            # H200 at 04:53 UTC 2026-12-05, `restart` first in both cycles: its recomputes 1.08x `never`'s
            # same recomputes turn by turn, the advisor having chosen as `never` does on every turn).
            for label in (arms if cycle % 2 == 0 else arms[::-1]):
                restart_once(label, cycle, cmd + RESTARTS[label], cmds["mlxd_host_ssd"][1], logs[label], rows_ssd,
                             model_dir, ssd_dir, args, out, save)

    out["summary"] = summarize(out, wanted)
    for name in wanted:
        for row in out.get(name, {}).get("rows", []):
            row.pop("history", None)
    keep_logs()
    save()
    log("summary", json.dumps(out["summary"], indent=1))
    print_stages(out["summary"])
    log("->", res, f"({out['elapsed_s']} s)")
    return 0


def restart_once(label: str, cycle: int, cmd: list[str], port: int, logpath: Path, rows_ssd: list[dict[str, Any]],
                 model_dir: Path, ssd_dir: Path, args: argparse.Namespace, out: dict[str, Any], save: Any) -> None:
    """One restart of the host + SSD server on its files (arm `label`, `cycle` of --restart-cycles): every
    round's returning turn, what the advisor chose and predicted after each. A forced arm leaves the advisor's
    file as it found it: the advisor arm's processes resume only what the advisor arm measured."""
    import httpx

    if args.restart_page_cache == "drop":
        drop_page_cache(ssd_dir)
    kept = {} if label == "restart" else advisor_files(ssd_dir)
    again = Proc(label, cmd, port, "/health", logpath)
    entry = out.setdefault(label, {})
    proc: dict[str, Any] = {"cycle": cycle}
    entry.setdefault("processes", []).append(proc)
    try:
        # what of the tier's files the page cache held as this server started (GB): the arms alike?
        proc["page_cache_gb_at_start"] = page_cache_gb(ssd_dir)
        proc["start_s"] = again.start(timeout=args.start_timeout)
        proc["page_cache_gb_at_first_turn"] = page_cache_gb(ssd_dir)
        if cycle == 0:  # the first process's, under the keys before --restart-cycles
            entry.update({k: proc[k] for k in ("page_cache_gb_at_start", "start_s", "page_cache_gb_at_first_turn")})
            entry["returning"], entry["turns"] = [], []
        for r in rows_ssd:
            entry["returning"].append(asyncio.run(ttft(again.base, model_dir.name, r["history"])))
            entry["turns"].append({**turn_report(httpx.get(again.base + "/stats", timeout=30).json()),
                                   "cycle": cycle})
            save()
        stats = httpx.get(again.base + "/stats", timeout=30).json()
        entry["stats"] = stats.get("ssd_cache")  # the last process's
        entry["device_probe"] = stats.get("device_probe")
        entry["advisor"] = proc["advisor"] = advisor_report(stats)
        mine = [t for t in entry["turns"] if t.get("cycle") == cycle]
        log(label, f"cycle {cycle}", [round(x["ttft_s"], 3) for x in entry["returning"][-len(mine):]],
            "restore ms", [t["restore_ms_last"] for t in mine],
            "page cache GB at start / first turn", proc["page_cache_gb_at_start"],
            proc["page_cache_gb_at_first_turn"], json.dumps(entry["advisor"]))
    except Exception as exc:
        out[f"{label}_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        entry["exit_code"] = proc["exit_code"] = again.stop()
        entry["log"] = done_lines(logpath)  # every process of this arm so far (the log file is appended to)
        if label != "restart":
            put_back_advisor_files(ssd_dir, kept)
        save()


def advisor_files(root: Path) -> dict[Path, bytes]:
    """The restore advisor's calibration files under the SSD tier (kv/advisor_file.py), as they are now."""
    from mlxd.kv.advisor_file import FILE_NAME

    return {p: p.read_bytes() for p in root.rglob(FILE_NAME)}


def put_back_advisor_files(root: Path, kept: dict[Path, bytes]) -> None:
    """The advisor's files as `advisor_files` saw them: what a forced arm's process saved is undone."""
    from mlxd.kv.advisor_file import FILE_NAME

    for p in root.rglob(FILE_NAME):
        if p not in kept:
            p.unlink()
    for p, data in kept.items():
        p.write_bytes(data)


# The restarts of the host + SSD server on its files: as its advisor decides, then each arm forced. The forced
# arms run as the advisor's does (`--device-probe auto`: the first server's saved probe, so the same prefill chunk
# size and no probe time; kv/probe_file.py): only the choice differs. (Before 19:10 UTC they ran with the probe
# off: the default 2,048-token prefill step where the advisor's arm had the probe's choice, 16,384 at 18:26.) The
# *_no_probe arms are those.
RESTARTS = {
    "restart": [],
    "restart_always": ["--restore-choice", "always"],
    "restart_never": ["--restore-choice", "never"],
    # every returning turn an overlapped split (the head recomputed while the tail is read: kv/restore_decision.py
    # OVERLAP) at the block boundary the advisor's costs put first, whatever the two arms cost
    "restart_overlap": ["--restore-choice", "overlap"],
    # the same in processes that reuse the saved probe and skip the start-up warm-up (`--device-warmup off`):
    # against restart_overlap (warmed on a GPU by default), what a cold process's first turns pay
    "restart_overlap_cold": ["--restore-choice", "overlap", "--device-warmup", "off"],
    # every restore forced, in a process that ran the startup probe: against restart_always_no_probe, what the
    # probe costs serving's restores (H200 16:17: the measured restart's second restore 1,468 ms, always's 916)
    # (`on`: measured afresh; `auto` reuses the probe the first server saved beside the files: kv/probe_file.py)
    "restart_always_probe": ["--restore-choice", "always", "--device-probe", "on"],
    "restart_always_no_probe": ["--restore-choice", "always", "--device-probe", "off"],
    "restart_never_no_probe": ["--restore-choice", "never", "--device-probe", "off"],
}
DEFAULT_ARMS = ("restart", "restart_always", "restart_never")


def turn_report(stats: dict[str, Any]) -> dict[str, Any]:
    """After one returning turn: its restore (ms, as the engine timed it), what the advisor chose and
    predicted, and what of the record it found in the page cache."""
    ssd = stats.get("ssd_cache") or {}
    d = ssd.get("restore_decisions") or {}
    return {"restores": ssd.get("restores"), "restore_ms_last": ssd.get("restore_ms_last"),
            "bytes_read": (ssd.get("prefetch") or {}).get("bytes_read"),
            **{k: d.get(k) for k in ("restores_chosen", "recomputes_chosen", "overlaps_chosen", "explorations",
                                     "forgone_s", "restore_retries",
                                     "recompute_tries", "recompute_forgone_s",
                                     "last_predicted_s", "last_recompute_s", "last_restore_s",
                                     "last_resident_bytes", "last_overlap_head_s", "last_overlap_read_s")},
            # the overlapped splits' tails the engine appended, recomputed instead, or declined
            **{k: (stats.get("engine") or {}).get(k) for k in ("overlap_tails", "overlap_tail_tokens",
                                                              "overlap_tails_recomputed", "overlap_tails_unplaced",
                                                              "overlaps_declined")},
            "event_loop": stats.get("event_loop"), "gc": stats.get("gc")}


def _tier_files(root: Path) -> list[Path]:
    """The SSD tier's data files: whole snapshots and blocks (not manifests, locks or tmp files)."""
    from mlxd.kv.block_store import BLOCK_EXT
    from mlxd.kv.file_format import EXTENSION

    return [Path(d) / n for d, _, names in os.walk(root) for n in names if n.endswith((EXTENSION, BLOCK_EXT))]


def page_cache_gb(root: Path) -> float:
    """GB of the SSD tier's files in the page cache now (mincore)."""
    from mlxd.kv.ssd_store import resident_pages

    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for f in _tier_files(root):
        try:
            total += resident_pages(f)[0] * page
        except OSError:
            pass
    return round(total / 1e9, 3)


def drop_page_cache(root: Path) -> None:
    """Ask the kernel to forget the SSD tier's (flushed, clean) pages: the next server reads them cold."""
    for f in _tier_files(root):
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def advisor_report(stats: dict[str, Any]) -> dict[str, Any]:
    """A restarted server's restore advisor: its choices, the arms it predicted last (seconds), the
    startup probe's restore bandwidth and the served one (its first measured restore, then averaged)."""
    d = (stats.get("ssd_cache") or {}).get("restore_decisions") or {}
    probe = stats.get("device_probe") or {}
    chosen = [k for k in ("restores_chosen", "recomputes_chosen", "splits_chosen", "overlaps_chosen") if d.get(k)]
    served = d.get("restore_bytes_per_s") if d.get("restore_samples") else None
    served_cached = d.get("page_cache_bytes_per_s") if d.get("page_cache_samples") else None
    return {
        "choices": {k: d.get(k, 0) for k in ("restores_chosen", "recomputes_chosen", "splits_chosen", "overlaps_chosen",
                                             "explorations",
                                             "forgone_s", "recompute_tries", "recompute_forgone_s")},
        "chosen": ",".join(k.removesuffix("s_chosen") for k in chosen) or None,
        "predicted_s": {"chosen": d.get("last_predicted_s"), "recompute": d.get("last_recompute_s"),
                        "restore": d.get("last_restore_s"), "explored": d.get("last_explored")},
        "probe_restore_gb_s": probe["restore_bytes_per_s"] / 1e9 if probe.get("restore_bytes_per_s") else None,
        # the probe's same file again from the page cache (what a restarted server's newest files read at)
        "probe_page_cache_gb_s": probe["page_cache_bytes_per_s"] / 1e9 if probe.get("page_cache_bytes_per_s") else None,
        "last_resident_gb": (d.get("last_resident_bytes") or 0) / 1e9,
        "probe_restore_landing": probe.get("restore_landing"), "probe_restore_layout": probe.get("restore_layout"),
        "served_restore_gb_s": served / 1e9 if served else None,
        "restore_samples": d.get("restore_samples", 0),
        # served restores the page cache held (mincore, at the choice): calibrate the page cache's bandwidth
        "served_page_cache_gb_s": served_cached / 1e9 if served_cached else None,
        "page_cache_samples": d.get("page_cache_samples", 0),
        # the probe's prefill model scaled by the served chunks' timings (at the end of the restart)
        "prefill_scale": d.get("prefill_scale"), "prefill_samples": d.get("prefill_samples", 0),
        "probe_prefill_tokens_per_s": probe.get("prefill_tokens_per_s"), "probe_seconds": probe.get("seconds"),
        "probe_reused": probe.get("reused"),  # the first server's probe, saved beside the files: none ran here
        "probe_warmup": probe.get("warmup"),  # {tokens, seconds} of the reused probe's untimed prefill at start
        "restore_ms_last": (stats.get("ssd_cache") or {}).get("restore_ms_last"),
    }


def failing_servers(runs: list[dict[str, Any]], r: int) -> list[str]:
    """The servers whose every run in rounds r - 1 and r failed (a dead generation thread, a lost device)."""
    import interleave

    if r < 1:
        return []
    by_server: dict[str, list[bool]] = {}
    for run in runs:
        if run["round"] in (r - 1, r):
            by_server.setdefault(interleave.server_of(run["slot"]), []).append(run["tok_s"] is None)
    return sorted(name for name, failed in by_server.items() if failed and all(failed))


def shared_budget_gb(servers: int, args: argparse.Namespace) -> str | None:
    """Each mlxd server's --memory-budget where several share one GPU (None: one server, the CPU, or --no-share).

    Every server here runs at once on one device. mlxd's default budget is 0.75 x the GPU's memory (and its
    buffer cache an eighth of that on top), each for one process: three servers overran an H100 (2026-12-07
    09:30, 09:44 and 09:53: "out of memory", then "an illegal memory access", in every server, mlx_lm.server
    too). mlx_lm.server has no such setting (it held up to 14.2 GiB there); each mlxd gets 0.7 x the device's
    memory / the servers, which with its buffer cache and CUDA's own leaves mlx_lm.server its share.
    """
    if args.small or args.no_share or servers < 2:
        return None
    info = dict(mx.device_info()) if hasattr(mx, "device_info") else {}
    total = info.get("total_memory") or info.get("memory_size")
    if not isinstance(total, int) or total <= 0 or mx.default_device().type != mx.gpu:
        return None
    return f"{0.7 * total / servers / 2**30:.1f}"  # (mlxd's GB are GiB)


def first_error(text: str, size: int = 3000) -> str | None:
    """A server log from its first traceback or error-level event on (None without one)."""
    starts = [i for i in (text.find("Traceback"), text.find('"level": "error"'), text.find("RuntimeError")) if i >= 0]
    if not starts:
        return None
    at = text.rfind("\n", 0, min(starts)) + 1
    return text[at:at + size]


def sample_gpu_memory(procs: dict[str, Any], into: list[Any], every: float = 3.0) -> None:
    """Append [seconds since start, total MiB used, {server: MiB}] every few seconds while nvidia-smi answers."""
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return
    t0 = time.perf_counter()
    while True:
        try:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10).stdout
            total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return
        names = {p.proc.pid: name for name, p in procs.items() if p.proc is not None}
        used: dict[str, int] = {}
        for line in apps.splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip().isdigit() and mib.strip().isdigit():
                used[names.get(int(pid), pid.strip())] = int(mib)
        into.append([round(time.perf_counter() - t0, 1), int(total.split()[0]) if total.split() else None, used])
        time.sleep(every)


def dir_bytes(root: Path) -> int:
    """Bytes of the files under `root` (the SSD tier's files: what a flush adds to it)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


def raw_write_s(directory: Path, nbytes: int, piece: int = 8 << 20) -> float:
    """Seconds to write `nbytes` as one file in `piece`-byte writes and fsync it, in `directory`."""
    path = directory / ".raw-write-probe"
    buf = os.urandom(piece)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(piece, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink(missing_ok=True)
    return seconds


def flush_report(flushed: dict[str, Any], written: int, directory: Path) -> dict[str, Any]:
    """The SIGTERM flush's rate (the bytes its files added ÷ the server's own flush seconds) against the
    disk's write bandwidth (one file of as many bytes, 256 MiB to 2 GiB, 8 MiB writes + fsync, same disk)."""
    seconds = float(flushed.get("seconds") or 0.0)
    size = max(256 << 20, min(2 << 30, written))
    try:
        raw = size / raw_write_s(directory, size)
    except OSError as exc:
        return {"error": repr(exc)}
    # A few bytes (the advisor's file, pins) say nothing about the rate: write-behind had it all on disk.
    rate = written / seconds if seconds > 0 and written >= 16 << 20 else None
    # where the flush's seconds went (its report: the writes it waited for, thread-seconds; absent before c05e6e4)
    split = {k: flushed[k] for k in ("writes", "written_bytes", "stage_s", "pwrite_s", "sync_s", "files_s")
             if k in flushed}
    return {"flush_s": seconds, "flushed_bytes": written, "durable_bytes": flushed.get("bytes"),
            "flush_gb_s": rate / 1e9 if rate else None, "disk_write_gb_s": raw / 1e9,
            "flush_vs_disk": rate / raw if rate else None, "split": split,
            "note": "flushed_bytes: what the files gained between SIGTERM and exit; under 16 MiB, write-behind had "
                    "written the backlog before the signal and no rate is given (bench_flush.py holds it back)"}


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def summarize(out: dict[str, Any], wanted: list[str]) -> dict[str, Any]:
    """Medians per server, then the issue's goals as ratios (None where an arm did not run)."""
    med: dict[str, dict[str, Any]] = {}
    for name in wanted:
        rows = out.get(name, {}).get("rows") or []
        m = {k: median([r[k]["ttft_s"] for r in rows if k in r]) for k in ("cold", "hit", "next", "returning")}
        for n, d in (out.get(name, {}).get("decode") or {}).items():
            m[f"decode_{n}_tok_s"] = d.get("tok_s")
        med[name] = m
    for label in RESTARTS:
        rs = out.get(label, {}).get("returning") or []
        if rs:
            med[label] = {"returning": median([r["ttft_s"] for r in rs])}
    lm, ssd, host, ram, tight = (med.get(k, {}) for k in ("mlx_lm", "mlxd_host_ssd", "mlxd_host", "mlxd_ram",
                                                            "mlxd_host_tight"))
    no_ssd = host or ram
    goals: dict[str, Any] = {
        "next_turn_ssd_vs_mlx_lm (goal <= 1.0)": ratio(ssd.get("next"), lm.get("next")),
        "next_turn_no_ssd_vs_mlx_lm (goal <= 1.0)": ratio(no_ssd.get("next"), lm.get("next")),
    }
    for n in ("1", "8"):
        key = f"decode_{n}_tok_s"
        goals[f"decode_{n}_streams_ssd_vs_mlx_lm (goal >= 1.0)"] = ratio(ssd.get(key), lm.get(key))
        goals[f"decode_{n}_streams_ssd_vs_mlxd_no_ssd"] = ratio(ssd.get(key), no_ssd.get(key))
    hold = med.get("mlxd_host_ssd_hold", {})
    lm_runs = (out.get("mlx_lm") or {}).get("decode_runs") or {}
    for n in ("1", "8"):
        if hold:
            goals[f"decode_{n}_streams_ssd_hold_vs_mlx_lm (goal >= 1.0)"] = ratio(hold.get(f"decode_{n}_tok_s"),
                                                                                 lm.get(f"decode_{n}_tok_s"))
        for name in ("mlxd_host_ssd", "mlxd_host_ssd_hold", "mlxd_ram", "mlxd_host"):
            runs = ((out.get(name) or {}).get("decode_runs") or {}).get(n) or []
            if runs and lm_runs.get(n) and "decode_interleaved" not in out:  # paired by repeat: the i-th decode of this level on each server
                goals[f"decode_{n}_paired_{name}_vs_mlx_lm"] = [
                    ratio(a.get("tok_s"), b.get("tok_s")) for a, b in zip(runs, lm_runs[n], strict=False)]
    goals.update(interleaved_goals(out))
    # The goal holds "in every run": each round's next turn against mlx_lm's of the same round (same prompt)
    lm_rows = (out.get("mlx_lm") or {}).get("rows") or []
    goals["next_turn_per_round_vs_mlx_lm"] = {
        name: [ratio(r["next"]["ttft_s"], m["next"]["ttft_s"]) for r, m in zip(
            out[name].get("rows") or [], lm_rows, strict=False) if "next" in r and "next" in m]
        for name in wanted if name.startswith("mlxd") and lm_rows}
    for arm in ("unfused", "apart", "handover", "both", "plain", "keep"):
        m = med.get(f"mlxd_ram_{arm}", {})
        if m:
            goals[f"next_turn_ram_{arm}_vs_mlx_lm"] = ratio(m.get("next"), lm.get("next"))
            goals[f"next_turn_ram_{arm}_vs_mlxd_ram"] = ratio(m.get("next"), ram.get("next"))
            goals[f"cold_ram_{arm}_vs_mlxd_ram"] = ratio(m.get("cold"), ram.get("cold"))
    for name, m in (("mlxd_host", host), ("mlxd_host_tight", tight), ("mlxd_host_ssd", ssd), ("mlxd_ram", ram)):
        if m:  # returning after B and C pushed A out of the RAM tier (mlxd_host_tight: out of HBM), against a
            # RAM hit of the same shape (the next turn)
            goals[f"returning_vs_ram_hit_{name}" + (" (goal <= 1.2)" if name == "mlxd_host_tight" else "")] = ratio(
                m.get("returning"), m.get("next"))
    if tight:
        goals["next_turn_host_tight_vs_mlx_lm (goal <= 1.0)"] = ratio(tight.get("next"), lm.get("next"))
    served = {name: server_side(out[name]) for name in ("mlxd_host", "mlxd_host_tight", "mlxd_ram", "mlxd_ram_unfused",
                                                        "mlxd_ram_apart", "mlxd_ram_handover", "mlxd_ram_both",
                                                        "mlxd_ram_plain", "mlxd_ram_clear", "mlxd_ram_late",
                                                        "mlxd_ram_notrim", "mlxd_ram_filter", "mlxd_ram_joinearly",
                                                        "mlxd_host_ssd") if name in out}
    restart = med.get("restart", {}).get("returning")
    restore = med.get("restart_always", {}).get("returning")
    # The recompute arm: a restart that never restores; else a cold prompt of about the same length.
    recompute = med.get("restart_never", {}).get("returning") or ssd.get("cold")
    arms = [x for x in (restore, recompute) if x is not None and x == x]
    best = min(arms) if arms else None
    goals["restart_vs_min_restore_recompute (goal <= 1.05)"] = ratio(restart, best)
    goals["restart_arms_s"] = {"chosen": restart, "restore": restore, "recompute": recompute,
                               "recompute_from": "restart_never" if med.get("restart_never") else "cold"}
    overlap = med.get("restart_overlap", {}).get("returning")
    if overlap is not None:  # the forced overlapped split against the better of the two arms
        goals["restart_arms_s"]["overlap"] = overlap
        goals["restart_overlap_vs_min_restore_recompute"] = ratio(overlap, best)
    # Per restart: each returning turn's TTFT, and what the advisor chose and predicted.
    restarts = {label: {"returning_s": [r["ttft_s"] for r in out[label].get("returning") or []],
                        # each turn's restore as the engine timed it (the same ms again: that turn recomputed)
                        "restore_ms": [t.get("restore_ms_last") for t in out[label].get("turns") or []],
                        "page_cache_gb_at_start": out[label].get("page_cache_gb_at_start"),
                        **(out[label].get("advisor") or {})}
                for label in RESTARTS if label in out}
    for label in restarts:
        restarts[label]["per_turn"] = restart_turns(out[label])
    # The same goal on the server's clock (request.done ttft_ms: submission to first token), where the advisor
    # predicts its arms: the client's time adds the HTTP side (the 16k-token prompt's chat template, 50-145 ms on
    # the H200) to every arm alike.
    server_med = {label: median([t["server_ttft_s"] for t in restarts[label]["per_turn"]
                                 if t.get("server_ttft_s") is not None]) for label in restarts}
    server_best = [server_med[k] for k in ("restart_always", "restart_never") if k in server_med
                   and server_med[k] == server_med[k]]
    if "restart" in server_med and server_best:
        goals["restart_vs_min_server_ttft"] = ratio(server_med["restart"], min(server_best))
    if "restart_overlap" in server_med and server_best:
        goals["restart_overlap_vs_min_server_ttft"] = ratio(server_med["restart_overlap"], min(server_best))
    if "restart_overlap_cold" in restarts:  # the start-up warm-up (on a GPU by default) against none
        goals["restart_overlap_warm_vs_cold"] = ratio(med.get("restart_overlap", {}).get("returning"),
                                                      med.get("restart_overlap_cold", {}).get("returning"))
        # where it should show: each process's first returning turn (a reused probe ran no forward before it)
        firsts = {label: median([t["server_ttft_s"] for i, t in enumerate(turns)
                                 if (i == 0 or turns[i - 1]["cycle"] != t["cycle"]) and t.get("server_ttft_s") is not None])
                  for label in ("restart_overlap", "restart_overlap_cold") if (turns := restarts.get(label, {}).get("per_turn"))}
        goals["restart_overlap_first_turns_server_s"] = firsts
        goals["restart_overlap_first_turn_warm_vs_cold"] = ratio(firsts.get("restart_overlap"),
                                                                 firsts.get("restart_overlap_cold"))
    probed, unprobed = (med.get(k, {}).get("returning") for k in ("restart_always_probe", "restart_always_no_probe"))
    if probed is not None:  # the probe's cost to serving's restores: the same forced arm with and without it
        goals["restart_always_with_probe_vs_without"] = ratio(probed, unprobed)
    for forced in ("restart_always", "restart_never"):  # the same forced arm with the saved probe and without one
        ratio_ = ratio(med.get(forced, {}).get("returning"), med.get(forced + "_no_probe", {}).get("returning"))
        if ratio_ is not None:
            goals[f"{forced}_saved_probe_vs_no_probe"] = ratio_
    flush = (out.get("mlxd_host_ssd") or {}).get("flush")
    return {"medians_s": med, "goals": goals, "restarts": restarts, "served_turns": served,
            **({"flush": flush} if flush else {})}


def interleaved_goals(out: dict[str, Any]) -> dict[str, Any]:
    """Decode's goals from the interleaved (or bracket) schedule, under the keys the serial one fills: each
    the median of the per-round ratios (not a ratio of two medians); `decode_N_paired_X_vs_mlx_lm` the
    per-round ratios in round order; `decode_N_iqr_X_vs_mlx_lm` their IQR; `decode_N_control_mlx_lm_vs_mlx_lm`
    the reference against itself in the same schedule (median, IQR): the noise a ratio carries here."""
    import interleave

    rec = out.get("decode_interleaved") or {}
    if not rec.get("runs"):
        return {}
    # from the runs, not the summary of the last whole level: a run cut short by SIGTERM still counts its rounds
    summary = interleave.summarize([interleave.Run(x["round"], x["streams"], x["at"], x["slot"], x["tok_s"])
                                    for x in rec["runs"]], rec["reference"], rec["schedule"])
    ref = summary.get("reference")
    goals: dict[str, Any] = {}
    for n, level in (summary.get("levels") or {}).items():
        table = level.get("ratio_to_" + str(ref)) or {}
        control = table.get(interleave.control_of(str(ref))) or {}
        goals[f"decode_{n}_control_{ref}_vs_{ref}"] = {"median": control.get("median"), "iqr": control.get("iqr"),
                                                        "rounds": control.get("n")}
        if ref != "mlx_lm":
            continue
        no_ssd = next((x for x in ("mlxd_host", "mlxd_ram") if x in table), None)
        if "mlxd_host_ssd" in table:
            goals[f"decode_{n}_streams_ssd_vs_mlx_lm (goal >= 1.0)"] = table["mlxd_host_ssd"]["median"]
            if no_ssd:
                goals[f"decode_{n}_streams_ssd_vs_mlxd_no_ssd"] = interleave.ratio_of(summary, n, "mlxd_host_ssd",
                                                                                     no_ssd)
        if "mlxd_host_ssd_hold" in table:
            goals[f"decode_{n}_streams_ssd_hold_vs_mlx_lm (goal >= 1.0)"] = table["mlxd_host_ssd_hold"]["median"]
        goals[f"decode_{n}_median_ratio_by_metric"] = by_metric(rec).get(n)
        for name, entry in table.items():
            if name in out:  # the servers, not the control slot
                goals[f"decode_{n}_paired_{name}_vs_mlx_lm"] = entry["values"]
                goals[f"decode_{n}_iqr_{name}_vs_mlx_lm"] = entry["iqr"]
    goals["decode_server_clock"] = {name: server_clock(out[name].get("log") or [], rec.get("decode_tokens"))
                                    for name in out if name.startswith("mlxd") and isinstance(out[name], dict)}
    return goals


def server_clock(log_lines: list[dict[str, Any]], tokens: int | None) -> dict[str, Any]:
    """A server's own account of its decode runs (request.done of requests of `tokens` tokens), by how many
    ended together (within 0.3 s: one decode run's streams): ms per token after the first, and `leave_ms`, the
    engine's time leaving each row in its last step (the final checkpoint; with the SSD tier its write plan),
    summed over the rows that ended together: what every last token of that run waited for."""
    from datetime import datetime

    done = [x for x in log_lines if x.get("event") == "request.done" and x.get("completion_tokens") == tokens
            and tokens and x.get("total_ms") is not None and x.get("ttft_ms") is not None]
    groups: list[list[tuple[float, dict[str, Any]]]] = []
    for x in done:
        at = datetime.fromisoformat(str(x["timestamp"]).replace("Z", "+00:00")).timestamp()
        if not groups or at - groups[-1][-1][0] > 0.3:
            groups.append([])
        groups[-1].append((at, x))
    out: dict[str, Any] = {}
    for n in sorted({len(g) for g in groups}):
        runs = [g for g in groups if len(g) == n]
        per_token = [(x["total_ms"] - x["ttft_ms"]) / (tokens - 1) for g in runs for _, x in g] if tokens > 1 else []
        leave = [sum(x.get("leave_ms") or 0.0 for _, x in g) for g in runs if any("leave_ms" in x for _, x in g)]
        out[str(n)] = {"runs": len(runs),
                       "ms_per_token_median": round(statistics.median(per_token), 3) if per_token else None,
                       "leave_ms_sum_median": round(statistics.median(leave), 2) if leave else None}
    return out


def restart_turns(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Each returning turn of a restart, in order: the client's time, the server's (request.done ttft_ms), the
    arm taken (restore / explore / recompute / recompute_try / overlap / overlap_recomputed, from the advisor's and
    the engine's counts after the turn) and what the advisor
    predicted for it and for the other arm, the restore as the engine timed it (read + adoption), what the
    turn cost beyond that restore (ttft - restore), and its parts: the HTTP side's template (`render_ms`,
    before submission: outside ttft), the engine's first forward over the restored pages or the whole prefill,
    the checkpoint of a recomputed prefix."""
    log_lines = entry.get("log") or []
    done = [x for x in log_lines if x.get("event") == "request.done"]
    http = {x.get("request_id"): x for x in log_lines if x.get("event") == "request.http"}
    out: list[dict[str, Any]] = []
    prev: dict[str, Any] = {}
    for i, (turn, after) in enumerate(zip(entry.get("returning") or [], entry.get("turns") or [], strict=False)):
        if after.get("cycle") != prev.get("cycle"):  # a new process (--restart-cycles): its counts start at 0
            prev = {"cycle": after.get("cycle")}
        grown = {k for k, v in after.items() if isinstance(v, int | float) and v > (prev.get(k) or 0)}
        # an overlapped split reads its tail through the tier (a restore there): its own arm, its tail appended
        # or recomputed (the engine's counts)
        overlapped = "overlaps_chosen" in grown
        restored = "restores" in grown and not overlapped
        explored, tried = "explorations" in grown, "recompute_tries" in grown
        arm = ("explore" if explored else
               ("overlap" if "overlap_tails" in grown else "overlap_recomputed") if overlapped else
               "restore" if restored else "recompute_try" if tried else "recompute")
        prev = after
        d = done[i] if i < len(done) else {}
        f = d.get("first_token_ms") or {}
        ms = (http.get(d.get("request_id")) or {}).get("ms") or {}
        ttft_s = d["ttft_ms"] / 1000 if d.get("ttft_ms") is not None else None
        restore_s = after["restore_ms_last"] / 1000 if restored and after.get("restore_ms_last") else None
        predicted = (after.get("last_predicted_s") if overlapped else
                     after.get("last_restore_s") if restored else after.get("last_recompute_s"))
        out.append({
            "cycle": after.get("cycle", 0), "client_s": turn.get("ttft_s"), "server_ttft_s": ttft_s,
            "arm": arm, "predicted_s": predicted,
            # the better of the arms not taken (for an overlap: recomputing)
            "predicted_other_s": after.get("last_recompute_s") if restored or overlapped else after.get("last_restore_s"),
            "predicted_vs_server": ratio(predicted, ttft_s),
            # after this turn: what recomputes chosen over an unmeasured restore forwent (the ski-rental sum), and
            # what of the record the page cache held at the choice
            "forgone_s": after.get("forgone_s"), "resident_bytes": after.get("last_resident_bytes"),
            "restore_s": restore_s,
            "beyond_restore_ms": round((ttft_s - restore_s) * 1000, 2) if ttft_s and restore_s else None,
            "render_ms": _span(ms, "images", "rendered"), "http_before_submit_ms": ms.get("submitted"),
            "queued_ms": d.get("queued_ms"), "join_ms": f.get("join"), "forward_ms": f.get("forward"),
            "first_step_ms": (f.get("step_ms") or [None])[0], "checkpoint_ms": f.get("checkpoint"),
            "steps": f.get("steps"),
            # an overlapped split's engine half: the head recomputed, the wait for its tail, the rest (recomputing
            # on while the tail was out, appending it)
            "lend_ms": f.get("lend"), "overlap_head_ms": f.get("overlap_head"),
            "overlap_wait_ms": f.get("overlap_wait"), "overlap_rest_ms": f.get("overlap_rest"),
            # and its halves as the advisor predicted them (the head recomputed, the tail read beside it)
            "predicted_head_s": after.get("last_overlap_head_s") if overlapped else None,
            "predicted_read_s": after.get("last_overlap_read_s") if overlapped else None,
        })
    return out


def server_side(entry: dict[str, Any]) -> dict[str, Any]:
    """Each round's hit, next and returning turn as the server logged it (request.done: ttft_ms, lookup_ms,
    promoted_bytes, promote_ms: the promotion's issue, promote_landed_ms: issue until its pages were back;
    first_token_ms: the engine's part, split; request.http: the HTTP side's stages), matched to the client's
    turn by prompt and cached tokens; `stages_ms`: the median of each stage per turn kind (stage_rows)."""
    log_lines = entry.get("log") or []
    lines = [x for x in log_lines if x.get("event") == "request.done"]
    http = {x.get("request_id"): x for x in log_lines if x.get("event") == "request.http"}
    found: dict[str, Any] = {"hit": [], "next": [], "returning": []}
    for row in entry.get("rows") or []:
        for k in ("hit", "next", "returning"):
            c = row.get(k) or {}
            hit = next((x for x in lines if x.get("prompt_tokens") == c.get("prompt_tokens")
                        and x.get("cached_tokens") == c.get("cached_tokens")), None)
            if hit is not None:
                lines.remove(hit)
                found[k].append({f: hit.get(f) for f in ("ttft_ms", "queued_ms", "lookup_ms", "promoted_bytes",
                                                         "promote_ms", "promote_landed_ms", "cache_tier",
                                                         "first_token_ms")}
                                | {"client_s": c.get("ttft_s"), **client_gaps(c, http.get(hit.get("request_id")))})
    found["stages_ms"] = {k: stage_rows(found[k]) for k in ("hit", "next", "returning") if found[k]}
    return found


def client_gaps(turn: dict[str, Any], http: dict[str, Any] | None) -> dict[str, Any]:
    """The server's HTTP stages, and the client's part on one clock (perf_counter is CLOCK_MONOTONIC on Linux):
    from its send (a new connection each turn) to the server's arrival stamp, and from the first token's chunk
    written to the client reading it."""
    if not http:
        return {"http_ms": None}
    ms, arrived = http.get("ms") or {}, http.get("arrived")
    out: dict[str, Any] = {"http_ms": ms}
    if arrived is not None and turn.get("t0") is not None:
        out["send_ms"] = round((arrived - turn["t0"]) * 1000, 2)
        if turn.get("first") is not None and "first_chunk_sent" in ms:
            out["read_ms"] = round((turn["first"] - arrived) * 1000 - ms["first_chunk_sent"], 2)
    return out


# A turn from the client's send to its first token, stage by stage (ms; each the time since the one before):
# the HTTP side (request.http, since arrival), then the scheduler and engine (request.done's first_token_ms).
HTTP_STAGES = ("parsed", "rendered", "keyed", "submitted")
ENGINE_STAGES = ("to_engine", "lend", "join", "wait", "forward", "checkpoint", "other", "deliver")


def stage_rows(turns: list[dict[str, Any]]) -> dict[str, float | None]:
    """The median of each stage over `turns` (ms): arrival -> parsed -> rendered (template + tokens) ->
    keyed -> submitted (request built), lookup, the engine's split, then the handler's first token and
    its chunk written, the server's whole (arrival -> chunk written) and the client's."""
    def med(vals: list[float | None]) -> float | None:
        xs = [v for v in vals if v is not None]
        return round(median(xs), 2) if xs else None

    out: dict[str, float | None] = {"client.send": med([t.get("send_ms") for t in turns])}
    prev = "arrived"
    for name in HTTP_STAGES:
        out[f"http.{name}"] = med([_span(t.get("http_ms"), prev, name) for t in turns])
        prev = name
    out["queued"] = med([t.get("queued_ms") for t in turns])  # submitted -> the scheduler took it
    out["lookup"] = med([t.get("lookup_ms") for t in turns])
    for name in ENGINE_STAGES:
        out[f"engine.{name}"] = med([(t.get("first_token_ms") or {}).get(name) for t in turns])
    out["engine.steps"] = med([(t.get("first_token_ms") or {}).get("steps") for t in turns])
    for i in range(3):  # the first steps' own times (which of them holds the forward's time)
        out[f"engine.step{i + 1}"] = med([((t.get("first_token_ms") or {}).get("step_ms") or [None] * 3)[i]
                                          if len((t.get("first_token_ms") or {}).get("step_ms") or []) > i else None
                                          for t in turns])
    out["server_ttft"] = med([t.get("ttft_ms") for t in turns])
    out["http.first_token"] = med([(t.get("http_ms") or {}).get("first_token") for t in turns])
    out["http.first_chunk_sent"] = med([(t.get("http_ms") or {}).get("first_chunk_sent") for t in turns])
    out["client.read"] = med([t.get("read_ms") for t in turns])
    out["client"] = med([t["client_s"] * 1000 if t.get("client_s") is not None else None for t in turns])
    return out


def _span(ms: dict[str, float] | None, a: str, b: str) -> float | None:
    if not ms or b not in ms:
        return None
    return ms[b] - (ms.get(a, 0.0) if a != "arrived" else 0.0)


def print_stages(summary: dict[str, Any]) -> None:
    """One table: each mlxd server's hit and next turn, stage by stage (median ms), beside the client's
    time and mlx_lm's."""
    med = summary.get("medians_s") or {}
    cols: list[tuple[str, dict[str, float | None]]] = []
    for name, served in (summary.get("served_turns") or {}).items():
        for k in ("hit", "next"):
            if (served.get("stages_ms") or {}).get(k):
                cols.append((f"{name}:{k}", served["stages_ms"][k]))
    if not cols:
        return
    keys = list(cols[0][1])
    lm = med.get("mlx_lm") or {}
    print("stages (median ms)".ljust(24) + "".join(c[0][-22:].rjust(24) for c in cols), flush=True)
    for key in keys:
        print(key.ljust(24) + "".join(("-" if c[1].get(key) is None else f"{c[1][key]:.2f}").rjust(24)
                                      for c in cols), flush=True)
    if lm:
        print("mlx_lm client".ljust(24) + "".join(
            f"{lm.get(c[0].rsplit(':', 1)[1], float('nan')) * 1000:.2f}".rjust(24) for c in cols), flush=True)


if __name__ == "__main__":
    sys.exit(main())
