"""What the speculation gate timed (issue 23): n-gram at batch 8, t = 4, random prompts, round after round in one
engine; after each round the plain step's median and every verifying step's seconds by width (`StepCosts`, as
`SpeculationGate.can_pay` and `DraftLength` read them), the steps `can_pay` refused, the pending-token reads and
the verifying steps so far. Builds the `default` model at --model if it is missing.

    PYTHONPATH=src python benchmarks/trace_spec_costs.py [--rounds 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_pending_reads import requests  # noqa: E402

from mlxd.engine.core import EngineCore  # noqa: E402
from mlxd.engine.drive import run_rows  # noqa: E402
from mlxd.model import build_model  # noqa: E402

from serving import config_for  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/tmp/prmodel"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    if not (args.model / "config.json").exists():
        build_model(args.model, "default")
    core = EngineCore(config_for(args.model, speculative="ngram", prompt_cache_bytes=0))
    core.load()
    gate, counters, rng = core._drafts.gate, core._drafts.counters, random.Random(1)
    for r in range(args.rounds):
        run_rows(core, requests(rng, args.rows, args.tokens))
        plain = {rows: round(statistics.median(s) * 1e3, 1) for rows, s in gate.costs._plain.items()}
        verify = {rows: [(w, round(s * 1e3, 1)) for w, s in v] for rows, v in gate.costs._verify.items()}
        print(r, "plain ms", plain, "verify (width, ms)", verify, "refused", gate.cannot_pay, "reads",
              counters.pending_reads, "verifying steps", counters.verify_steps, flush=True)
    core.close()


if __name__ == "__main__":
    main()
