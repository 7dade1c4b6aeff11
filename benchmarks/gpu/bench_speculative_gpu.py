"""Speculative decoding on a GPU: bench_speculative.py on a Qwen3-1.7B-shaped bf16 random model.

On the CUDA host (docs/benchmarks.md, GPU): `source .gpu/b/install.sh && python3 benchmarks/gpu/bench_speculative_gpu.py`.
Builds the model under /tmp (never transferred), then runs both arms side by side in one process; the
result JSON lands in benchmarks/results/ (and $OUT when set).
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


def main() -> int:
    model = Path("/tmp/models/qwen3-1.7b-shape")
    if not (model / "config.json").exists():
        build(QWEN3_1_7B, model)
    args = [sys.executable, str(HERE.parent / "bench_speculative.py"), "--model", str(model), *sys.argv[1:]]
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
