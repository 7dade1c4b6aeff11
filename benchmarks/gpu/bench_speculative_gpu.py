"""Speculative decoding on a GPU: bench_speculative.py on a Qwen3-1.7B-shaped bf16 random model.

On the CUDA host (docs/benchmarks.md, GPU): `source .gpu/b/install.sh && python3 benchmarks/gpu/bench_speculative_gpu.py
[bench_speculative.py's flags]`; here on the CPU, `--small` builds the `default` preset's shape in bf16 instead
(to check the run end to end), and `--small-draft L` also a draft of that shape with L layers (a draft arm
cheaper than the target on the CPU, where `--draft-preset default` is the target's size: the gate's ceiling
never lets it verify). Builds the model under /tmp (never transferred), then runs the arms side by side
in one process (`--budget S`: S seconds for all of it, the build included); the result JSON lands in benchmarks/results/ and, after every case, in $OUT when set.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import attrs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_gpu import QWEN3_1_7B, build, run_streamed  # noqa: E402

from mlxd.model import presets  # noqa: E402


def main() -> int:
    began = time.perf_counter()
    argv = sys.argv[1:]
    small = "--small" in argv
    argv = [a for a in argv if a != "--small"]
    shape = attrs.evolve(presets.PRESETS["default"], name="default-bf16-shape") if small else QWEN3_1_7B
    model = Path(f"/tmp/models/{shape.name}")
    if not (model / "config.json").exists():
        build(shape, model)
    if "--small-draft" in argv:  # a draft of the target's shape with fewer layers (same vocabulary)
        at = argv.index("--small-draft")
        layers = int(argv[at + 1])
        del argv[at : at + 2]
        draft_shape = attrs.evolve(shape, name=f"{shape.name}-{layers}layer", num_hidden_layers=layers)
        draft = Path(f"/tmp/models/{draft_shape.name}")
        if not (draft / "config.json").exists():
            build(draft_shape, draft, seed=1)  # other weights: an unrelated draft
        argv += ["--draft", str(draft)]
    print(f"[{time.perf_counter() - began:.0f} s] model {model}", flush=True)
    if "--budget" in argv:  # seconds for the whole phase: the model build's are spent, a few for the imports
        at = argv.index("--budget")
        argv[at + 1] = f"{float(argv[at + 1]) - (time.perf_counter() - began) - 6:.0f}"
    args = [sys.executable, str(HERE.parent / "bench_speculative.py"), "--model", str(model), *argv]
    rc = run_streamed(args)
    print(f"[{time.perf_counter() - began:.0f} s] done, rc {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
