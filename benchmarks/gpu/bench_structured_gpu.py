"""Structured output on a GPU: bench_structured.py on a Qwen3-1.7B-shaped bf16 random model.

On the CUDA host (docs/benchmarks.md, GPU): `source .gpu/b/install.sh && python3 benchmarks/gpu/bench_structured_gpu.py`.
Builds the model under /tmp (never transferred), then runs the decode and grammar-TTFT comparison
in one process; the result JSON lands in benchmarks/results/ (and $OUT when set). Other arguments
go to bench_structured.py. `--small` drives the `default` preset instead (a check on a CPU host):
`python benchmarks/gpu/bench_structured_gpu.py --small --rounds 1 --tokens 8 --batch 1 2`.
`--prof` runs benchmarks/prof_structured_host.py on the same model instead (its other arguments
after it: `--prof --batch 8 --tokens 128 --mask-modes ahead-bool ahead-early`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_gpu import QWEN3_1_7B, build, run_streamed  # noqa: E402

from mlxd.model import presets  # noqa: E402


def main() -> int:
    rest = [a for a in sys.argv[1:] if a not in ("--small", "--prof")]
    preset = presets.PRESETS["default"] if "--small" in sys.argv else QWEN3_1_7B
    model = Path("/tmp/models") / (preset.name if preset is QWEN3_1_7B else f"{preset.name}-bf16")
    if not (model / "config.json").exists():
        build(preset, model)
    if "--prof" in sys.argv:  # where the host's time goes per step (no result JSON: the log is the result)
        prof = [sys.executable, str(HERE.parent / "prof_structured_host.py"), "--model", str(model), "--no-ops", *rest]
        return subprocess.run(prof, check=False).returncode
    args = [sys.executable, str(HERE.parent / "bench_structured.py"), "--model", str(model), *rest]
    return run_streamed(args)


if __name__ == "__main__":
    sys.exit(main())
