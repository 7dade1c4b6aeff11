"""`mlxd simulate`'s command line: its flags and their help, nothing that runs a replay.

Apart from `sim/cli.py` so that `mlxd serve`, whose parser lists every subcommand, does not
import the replay engine (and through trio.testing, pytest) to start.
"""

from __future__ import annotations

import argparse
from pathlib import Path

POLICIES = ("lru", "lfu", "cost")
DEFAULT_SWEEP = (1000, 2000, 5000, 10000, 20000, 50000)  # blocks
DESCRIPTION = "`mlxd simulate`: replay a request trace against the serving cache policies."


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="replay a request trace against the cache policies",
        description=DESCRIPTION,
    )
    configure_parser(p)
    return p


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", help="Mooncake or mlxd JSONL trace")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--ram-blocks", type=int, help="RAM capacity in 512-token blocks")
    cap.add_argument("--ram-gb", type=float, help="RAM capacity in GiB of KV")
    cap.add_argument(
        "--sweep",
        nargs="?",
        const="default",
        help="comma-separated capacities in blocks ('inf' = unlimited); "
        f"bare --sweep = {','.join(map(str, DEFAULT_SWEEP))}",
    )
    p.add_argument("--ssd-gb", type=float, help="add an SSD tier of this many GiB (mlxd model)")
    p.add_argument("--host-gb", type=float, default=None,
                   help="add a host-memory tier of this many GiB between RAM and SSD (mlxd model; "
                   "default: the recorded server's --host-cache-gb where it was in effect)")
    p.add_argument("--host-gbps", type=float, default=None,
                   help="host tier to device bandwidth in GB/s (default: the cost model's; 0 there = free)")
    p.add_argument("--kv-admission-gb", type=float, default=None,
                   help="admit a request only when its KV (input + output tokens x the cost model's KV bytes "
                   "per token) fits this many GiB beside the rows running, as --kv-admission does (mlxd model)")
    p.add_argument("--ram-pages", choices=("on", "off", "both"), default=None,
                   help="RAM entries as shared KV pages, counted once (mlxd model; both = each run twice, "
                   "pages and contiguous entries, and a table of the RAM bytes retained; default: recorded, "
                   "else off)")
    p.add_argument("--ram-page-tokens", type=int, default=None,
                   help="tokens per RAM page with --ram-pages (default: recorded, else 1024)")
    p.add_argument("--ssd-layout", choices=("whole", "blocks"), default=None,
                   help="SSD tier stores whole files or shared content-addressed blocks (default: recorded, else blocks, "
                   "as mlxd serve)")
    p.add_argument("--ssd-block-tokens", type=int, default=None,
                   help="tokens per block with --ssd-layout blocks (default: recorded, else 1024)")
    p.add_argument(
        "--policy", default=None,
        help=f"lru, lfu, cost, or a comma list (default: the recorded server's, else {','.join(POLICIES)})",
    )
    p.add_argument(
        "--cache-model", choices=("blocks", "mlxd", "both"), default=None,
        help="default: mlxd for a recorded server, else both",
    )
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--out", type=Path, help="write results JSON and PNG plots here")
    p.add_argument("--name", default=None, help="file stem under --out (default: trace name)")
    p.add_argument("--cost-model", type=Path,
                   help="cost model JSON (default: a recording's startup-probe model, else built-in)")
    p.add_argument("--prefill-sharing", choices=("auto", "on", "off"), default="auto",
                   help="rows prefilling at once share one engine's time (on) or each slot prefills at full "
                   "speed (off); auto = on when replaying a recorded server, else off")
    p.add_argument("--fit-ttft-out", type=Path, default=None,
                   help="fit a cost model to the recording's measured TTFTs (prefill from misses and RAM hits, "
                   "restore from SSD hits), write it here and exit; simulate another trace with --cost-model")
    p.add_argument("--fit-warmup", type=int, default=None, metavar="N",
                   help="with --fit-ttft-out: leave the recording's first N requests out of the fit (default 1: "
                   "the first request after a start pays one-off costs)")
    p.add_argument("--fit-outlier-fence", type=float, default=None, metavar="K",
                   help="with --fit-ttft-out: leave out of each tier's spread the requests above Q3 + K x IQR of "
                   "its log ratios (Tukey's far out: one-offs such as a first compile, not the tier's tail; "
                   "default 3, 0 = keep every request)")
    p.add_argument("--fit-outlier-floor", type=float, default=None, metavar="X",
                   help="with --fit-ttft-out: ... and only those above X times the tier's median (a one-off costs "
                   "several times a request's work; a tight tier's 1.3x tail is its p95; default 2, 1 = the "
                   "fence alone)")
    p.add_argument("--ttft-warmup", type=int, default=0, metavar="N",
                   help="leave each tier's first N requests out of the TTFT percentiles per tier (and, with "
                   "--fit-ttft-out, out of the fit): a tier's first use pays one-off costs (default 0)")
    p.add_argument(
        "--slots", type=int, default=None, help="simulated engine slots (default: the recorded max_batch, else 4)"
    )
    p.add_argument(
        "--snapshot-min-tokens", type=int, default=None,
        help="prefilled tokens that publish a prompt-boundary snapshot (default: recorded, else 256)",
    )
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument(
        "--no-sessions", action="store_true",
        help="ignore the trace's session field (no session index); by default a trace with sessions is "
             "replayed with the index, and each mlxd run is compared with a twin run without it",
    )
    p.add_argument("--granularity", choices=("auto", "block", "token"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=1,
                   help="simulate a fleet: N replicas (each with the RAM/SSD capacity and --slots given) behind --router")
    p.add_argument("--router", default="round_robin",
                   help="with --replicas: round_robin, session, cache_aware, or a comma list to compare")
    p.add_argument(
        "--calibrate", action="store_true", help="measure the cost model on this machine"
    )
    p.add_argument("--model", type=Path, help="model dir for --calibrate / text traces")
    p.add_argument("--calibrate-tokens", type=int, default=2048)
    p.add_argument(
        "--cost-out", type=Path, default=Path("cost_model.json"), help="where --calibrate writes"
    )
