# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What a step the speculation gate withholds costs with a draft model configured, next to speculation off.

Two engine cores over the same model (`default` preset): speculation off, and `--speculative draft`
with the model as its own draft whose gate never lets a step verify (a gate subclass: every step
withheld), and `off2`, speculation off again (the spread between two equal arms). They decode the
same non-repetitive t = 4 rows, rotating which goes first, at batch 1 and 8; printed per batch: the
median per-round decode tok/s ratios (draft ÷ off, off2 ÷ off) and the draft's counters (draft
steps and verify steps must be 0).

    python benchmarks/bench_withheld_steps.py [ROUNDS]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_speculative import _fields, workload  # noqa: E402

from mlxd import RuntimeConfig  # noqa: E402
from mlxd.engine.core import EngineCore  # noqa: E402
from mlxd.engine.drive import run_rows  # noqa: E402
from mlxd.kv.ngram import SpeculationGate, Step  # noqa: E402
from mlxd.model import ensure_model  # noqa: E402


class Never(SpeculationGate):
    def decide(self, rows: int) -> Step:
        self.steps += 1
        self.withheld += 1
        return "plain"


def main(rounds: int) -> None:
    model = ensure_model("default")
    base = RuntimeConfig(model=str(model), max_batch=8, prompt_cache_bytes=0, device_probe="off",
                         default_max_tokens=48, max_context=8192)
    cores = {"off": EngineCore(base), "self": EngineCore(RuntimeConfig(**{
        **_fields(base), "speculative": "draft", "draft_model": str(model), "num_draft_tokens": 4})),
        "off2": EngineCore(base)}  # speculation off again: the spread between two equal arms
    for c in cores.values():
        c.load()
    cores["self"]._drafts.gate = Never()
    for batch in (1, 8):
        reqs = workload("non-repetitive", batch, 48, 8000, 64, 4.0)
        for c in cores.values():
            run_rows(c, reqs)
        ratios, control = [], []
        arms = list(cores)
        for r in range(rounds):
            order = arms[r % 3:] + arms[: r % 3]
            got = {a: run_rows(cores[a], reqs).decode_tok_s() for a in order}
            ratios.append(got["self"] / got["off"])
            control.append(got["off2"] / got["off"])
        s = cores["self"].stats().speculation
        assert s is not None
        print(f"batch {batch}: withheld draft=self / off {statistics.median(ratios):.3f} "
              f"{[round(x, 3) for x in ratios]}, draft steps {s.draft_steps}, verify steps {s.verify_steps}; off2 / off "
              f"{statistics.median(control):.3f} {[round(x, 3) for x in control]}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
