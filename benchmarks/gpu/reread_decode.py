"""Committed decode runs read again under every metric (issue 28): `bench_host_tier_servers.by_metric` on each
result file's interleaved decode rounds, the median per-round ratio to mlx_lm.server per server and level.

    python benchmarks/gpu/reread_decode.py benchmarks/results/host_servers-h*-decodeil-*.json --label h-all

`median_stream_tok_s` is computed from the per-stream rates every run recorded, so files from before it was a
metric read the same as new ones. Writes benchmarks/results/decode-reread-LABEL-<time>.json and prints one line
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

from bench_host_tier_servers import DECODE_METRICS, by_metric  # noqa: E402

RESULTS = HERE.parent / "results"


def reread(path: Path) -> dict[str, Any] | None:
    """{level: {server: {metric: median ratio}}, "stream_tokens": N} for one result file (None without decode rounds)."""
    rec = json.loads(path.read_text()).get("decode_interleaved") or {}
    if not rec.get("runs"):
        return None
    return {"stream_tokens": rec.get("stream_tokens", 0), "levels": by_metric(rec)}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--label", default="reread")
    args = p.parse_args(argv)
    out: dict[str, Any] = {"metrics": list(DECODE_METRICS), "files": {}}
    for path in args.files:
        got = reread(path)
        if got is None:
            continue
        out["files"][path.name] = got
        for level, servers in got["levels"].items():
            cells = "  ".join(f"{slot} " + "/".join("-" if m.get(k) is None else f"{m[k]:.3f}" for k in DECODE_METRICS)
                              for slot, m in servers.items())
            print(f"{path.name} streams={level} stream_tokens={got['stream_tokens']}  {cells}", flush=True)
    print("(each cell: " + " / ".join(DECODE_METRICS) + ")")
    dest = RESULTS / f"decode-reread-{args.label}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    return dest


if __name__ == "__main__":
    main()
