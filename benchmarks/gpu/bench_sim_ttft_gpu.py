"""`mlxd simulate` TTFT per tier vs a recorded run on a GPU: bench_sim_ttft.py on a Qwen3-1.7B-shaped bf16 model.

On the CUDA host (docs/benchmarks.md): `source .gpu/b/install.sh && python3 benchmarks/gpu/bench_sim_ttft_gpu.py`
(or `bash benchmarks/gpu/wave3.sh simttft`). Builds the model under /tmp/models if it is missing (never
transferred), then records the calibration and the predicted (held-out) run and compares them in one
process: up to 48 conversations of a 1,024-token first prompt (a miss), 128-token turns (a RAM hit) and a
return restored from SSD (`--restore-choice always`, as the GPU would otherwise recompute them), so each
tier has >= 31 requests per run past its first (left out of both runs as warm-up: `--ttft-warmup 1`) and
its p95 is no single sample; 8 conversations at a time take both rounds (`--wave 8`), so a run the
deadline cuts keeps every tier. `--stop-after S` (default 135) bounds the whole run, the build included;
the result JSON lands in benchmarks/results/ (and $OUT when set). Other arguments go to bench_sim_ttft.py
and override these. `--small` drives the `default` preset instead (a check on a CPU host):
`python benchmarks/gpu/bench_sim_ttft_gpu.py --small --stop-after 60 --first 128 --new 16 --conversations 3 --turns 2`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_gpu import QWEN3_1_7B, build, run_streamed  # noqa: E402

from mlxd.model import presets  # noqa: E402

# 48 conversations: as many as the budget lets through (32-40 when the model is built first), cut by
# --stop-after at a turn both runs reached; --warmup 2: the warm-up's second first prompt comes after a RAM
# hit, as every later miss does, so its chunk shapes are compiled before the recorded runs.
GPU_ARGS = ["--first", "1024", "--new", "128", "--max-tokens", "2", "--conversations", "48", "--turns", "2",
            "--back-to-back", "2", "--ram-conversations", "2.5", "--restore-choice", "always", "--probe-s", "3",
            "--ttft-warmup", "1", "--wave", "8", "--warmup", "2"]
MARGIN_S = 5.0  # of --stop-after: the bench's own start and exit


def split_budget(argv: list[str]) -> tuple[float, list[str]]:
    """(--stop-after seconds, the other arguments)."""
    rest, budget, i = [], 135.0, 0
    while i < len(argv):
        if argv[i] == "--stop-after" and i + 1 < len(argv):
            budget, i = float(argv[i + 1]), i + 2
        elif argv[i].startswith("--stop-after="):
            budget, i = float(argv[i].split("=", 1)[1]), i + 1
        else:
            rest.append(argv[i])
            i += 1
    return budget, rest


def main() -> int:
    began = time.perf_counter()
    budget, rest = split_budget(sys.argv[1:])
    small = "--small" in rest
    rest = [a for a in rest if a != "--small"]
    preset = presets.PRESETS["default"] if small else QWEN3_1_7B
    model = Path("/tmp/models") / (preset.name if preset is QWEN3_1_7B else f"{preset.name}-bf16")
    if not (model / "config.json").exists():
        build(preset, model)
    left = budget - (time.perf_counter() - began) - MARGIN_S
    label = [] if "--label" in rest else ["--label", ("cpu-small-" if small else "gpu-") + os.uname().nodename]
    args = [sys.executable, str(HERE.parent / "bench_sim_ttft.py"), "--model", str(model), *GPU_ARGS, *label,
            "--stop-after", f"{max(left, 20.0):.0f}", *rest]  # later flags win (argparse)
    print(" ".join(args), flush=True)
    return run_streamed(args, result="wrote")


if __name__ == "__main__":
    sys.exit(main())
