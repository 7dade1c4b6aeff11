"""Speculation's pending-token reads at acceptance ~0 (issue 23): n-gram at batch 8, t = 4, random prompts, in one
process, interleaved with speculation off and with n-gram whose lookups never ask for the pending token
(`NgramDrafts.may_propose` forced False: no read, no draft). Wall seconds per run (prefill included), the reads and
the verifying steps. Builds the `default` model at --model if it is missing.

    PYTHONPATH=src python benchmarks/probe_pending_reads.py [--rounds 4] [--tokens 160]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mlxd import SamplingParams  # noqa: E402
from mlxd.engine import speculative  # noqa: E402
from mlxd.engine.core import EngineCore  # noqa: E402
from mlxd.engine.drive import run_rows  # noqa: E402
from mlxd.model import build_model  # noqa: E402
from mlxd.runtime.kernel.messages import GenerationRequest  # noqa: E402

from serving import config_for  # noqa: E402

ARMS = ("off", "ngram", "noread")
NO_EOS = ((0, -100.0), (2, -100.0))


def requests(rng: random.Random, rows: int, tokens: int) -> list[GenerationRequest]:
    return [GenerationRequest(request_id=f"r{i}", prompt=tuple(rng.randrange(3, 4000) for _ in range(200)),
                              sampling=SamplingParams(max_tokens=tokens, temperature=4.0, seed=i, logit_bias=NO_EOS))
            for i in range(rows)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/tmp/prmodel"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=160)
    args = p.parse_args()
    if not (args.model / "config.json").exists():
        build_model(args.model, "default")
    rng = random.Random(1)
    may_propose = speculative.NgramDrafts.may_propose
    cores = {}
    for arm in ARMS:
        core = EngineCore(config_for(args.model, speculative="off" if arm == "off" else "ngram", prompt_cache_bytes=0))
        core.load()
        cores[arm] = core
    walls: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            speculative.NgramDrafts.may_propose = (lambda self, tokens: False) if arm == "noread" else may_propose
            core = cores[arm]
            before = core._drafts.counters.pending_reads if core._drafts else 0
            t0 = time.perf_counter()
            run_rows(core, requests(rng, args.rows, args.tokens))
            walls[arm].append(time.perf_counter() - t0)
            spec = core.stats().speculation
            reads = core._drafts.counters.pending_reads - before if core._drafts else 0
            print(r, arm, f"{walls[arm][-1]:.3f} s", "reads", reads, "verifying steps (total)",
                  spec.verify_steps if spec else None, flush=True)
    speculative.NgramDrafts.may_propose = may_propose
    for arm, v in walls.items():
        print(arm, "median", round(statistics.median(v), 3), [round(x, 3) for x in v])
    for core in cores.values():
        core.close()


if __name__ == "__main__":
    main()
