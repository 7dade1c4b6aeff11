"""Committed decode runs read again under every metric (issue 28): `bench_host_tier_servers.by_metric` on each
result file's interleaved decode rounds, the median per-round ratio to mlx_lm.server per server and level.

    python benchmarks/gpu/reread_decode.py benchmarks/results/host_servers-h*-decodeil-*.json --label h-all

`median_stream_tok_s` is computed from the per-stream rates every run recorded, and `client_sum_tok_s` from each
stream's first and last token (`first_ms` / `last_ms`, from 2026-12-06; with `ttft_ms` from 2026-12-07 17:00), so
files from before they were metrics read the same as new ones. `--spread METRIC` adds, for that metric, each slot's
per-round IQR and how many rounds were at or over 1.0. Writes benchmarks/results/decode-reread-LABEL-<time>.json and prints one line
per file and level.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import interleave  # noqa: E402
from bench_host_tier_servers import DECODE_METRICS, by_metric, metric_of  # noqa: E402

RESULTS = HERE.parent / "results"


def reread(path: Path, spread_of: str | None = None) -> dict[str, Any] | None:
    """{level: {server: {metric: median ratio}}, "stream_tokens": N} for one result file (None without decode rounds);
    with `spread_of`, also {"spread": {level: {server: {median, iqr, n, at_least_1}}}} under that metric."""
    rec = json.loads(path.read_text()).get("decode_interleaved") or {}
    if not rec.get("runs"):
        return None
    out: dict[str, Any] = {"stream_tokens": rec.get("stream_tokens", 0), "levels": by_metric(rec)}
    if spread_of is not None:
        runs = [interleave.Run(x["round"], x["streams"], x["at"], x["slot"], metric_of(x, spread_of)) for x in rec["runs"]]
        levels = interleave.summarize(runs, rec["reference"], rec["schedule"])["levels"]
        out["spread"] = {n: {slot: {"median": e["median"], "iqr": e["iqr"], "n": e["n"],
                                    "at_least_1": sum(1 for v in e["values"] if v is not None and v >= 1.0)}
                             for slot, e in level["ratio_to_" + rec["reference"]].items()}
                         for n, level in levels.items()}
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--label", default="reread")
    p.add_argument("--spread", choices=DECODE_METRICS, help="also each slot's IQR and rounds >= 1.0 under this metric")
    args = p.parse_args(argv)
    out: dict[str, Any] = {"metrics": list(DECODE_METRICS), "spread_of": args.spread, "files": {}}
    for path in args.files:
        got = reread(path, args.spread)
        if got is None:
            continue
        out["files"][path.name] = got
        for level, servers in got["levels"].items():
            cells = "  ".join(f"{slot} " + "/".join("-" if m.get(k) is None else f"{m[k]:.3f}" for k in DECODE_METRICS)
                              for slot, m in servers.items())
            print(f"{path.name} streams={level} stream_tokens={got['stream_tokens']}  {cells}", flush=True)
            for slot, e in (got.get("spread") or {}).get(level, {}).items():
                iqr = "-" if e["iqr"] is None else f"{e['iqr'][0]:.3f}-{e['iqr'][1]:.3f}"
                print(f"    {args.spread} {slot} {e['median']} [{iqr}] >= 1.0 in {e['at_least_1']} of {e['n']}")
    print("(each cell: " + " / ".join(DECODE_METRICS) + ")")
    dest = RESULTS / f"decode-reread-{args.label}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    return dest


if __name__ == "__main__":
    main()
