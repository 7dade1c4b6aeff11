"""Structured output on a GPU: bench_structured.py on a Qwen3-1.7B-shaped bf16 random model.

On the CUDA host (docs/benchmarks.md, GPU): `source .gpu/b/install.sh && python3 benchmarks/gpu/bench_structured_gpu.py`.
Builds the model under /tmp (never transferred), then runs the decode and grammar-TTFT comparison
in one process; the result JSON lands in benchmarks/results/ (and $OUT when set). Other arguments
go to bench_structured.py. `--small` drives the `default` preset instead (a check on a CPU host):
`python benchmarks/gpu/bench_structured_gpu.py --small --rounds 1 --tokens 8 --batch 1 2`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_gpu import QWEN3_1_7B, build  # noqa: E402

from mlxd.model import presets  # noqa: E402


def main() -> int:
    rest = [a for a in sys.argv[1:] if a != "--small"]
    preset = presets.PRESETS["default"] if len(rest) < len(sys.argv) - 1 else QWEN3_1_7B
    model = Path("/tmp/models") / (preset.name if preset is QWEN3_1_7B else f"{preset.name}-bf16")
    if not (model / "config.json").exists():
        build(preset, model)
    args = [sys.executable, str(HERE.parent / "bench_structured.py"), "--model", str(model), *rest]
    # Streamed, so a run cut short by the device's time limit still shows how far it got.
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout or ():
        print(line, end="", flush=True)
        lines.append(line.strip())
    proc.wait()
    result = next((line for line in reversed(lines) if line), "")
    if os.environ.get("OUT") and result.endswith(".json") and Path(result).exists():
        shutil.copy(result, os.environ["OUT"])
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
