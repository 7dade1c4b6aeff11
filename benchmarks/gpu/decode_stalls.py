"""Where the decode rounds of recorded servers-bench runs lost time (issue 28), read again from their JSON.

For each file (`bench_host_tier_servers.py` results with `decode_interleaved`) and each stream count and slot:
the median over runs of the streams' summed own rates over the rate while all rows decoded (below 1: time lost
before the last stream's first token or after the first stream's last), the median spread of the streams' own
rates in a run (fastest / slowest), and, in runs that recorded token times, the slow gaps (`stalls`).

    python benchmarks/gpu/decode_stalls.py benchmarks/results/host_servers-h*-decodeil-*.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_host_tier_servers import median, stalls  # noqa: E402


def read(path: Path) -> dict[str, Any]:
    runs = json.loads(path.read_text()).get("decode_interleaved", {}).get("runs", [])
    out = stalls(runs)
    for x in runs:
        rates = [r for r in x.get("per_stream_tok_s") or [] if r]
        if x.get("tok_s") is not None and len(rates) > 1:
            out[str(x["streams"])][x["slot"]].setdefault("spreads", []).append(max(rates) / min(rates))
    for level in out.values():
        for slot in level.values():
            spreads = slot.pop("spreads", [])
            slot["fastest_over_slowest"] = round(median(spreads), 4) if spreads else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--levels", default="8", help="stream counts to print (all are saved)")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results")
    args = ap.parse_args()
    result = {path.name: read(path) for path in args.files}
    for name, levels in result.items():
        for n in args.levels.split(","):
            print(name, f"{n} streams:", json.dumps({slot: [v["own_over_all_rows"], v["fastest_over_slowest"]]
                                                      for slot, v in levels.get(n, {}).items()}))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode_stalls-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"argv": sys.argv, "files": result}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
