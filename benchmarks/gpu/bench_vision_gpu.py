"""Vision on a GPU: bench_vision.py's 10-image ÷ text follow-up and encoder hit ÷ re-encode, on the device.

On the CUDA host (docs/benchmarks.md, GPU; the host is offline):

    mkdir -p /tmp/mlxpay && cp .gpu/a/p.aa /tmp/mlxpay/
    source .gpu/b/install.sh && python3 benchmarks/gpu/bench_vision_gpu.py

Extra arguments go to bench_vision.py (default here: --rounds 5 --images 10 --side 224 --route both,
the `bench-vlm` preset, a few minutes at most). `--route both` times the 10-image ÷ text follow-up
twice: on the chat route (every follow-up re-sends the 2 MB of images) and on /v1/responses (the
follow-up sends its new text with previous_response_id; the server holds the images). It also prints where the 10-image follow-up's wall
time goes against the text one's, stage by stage on both sides (client encode, body receive,
parse, images, render, submit, prefill, reply; `--stage-pairs`, default 8; http/stages.py). The server needs Pillow and transformers' Qwen2-VL
image processor (vision/images.py); without them this says so and stops. The client needs
neither httpx nor Pillow (bench_vision.py falls back to http.client and a hand-written PNG).
The result JSON lands in benchmarks/results/ (and $OUT when set).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULTS = ["--rounds", "5", "--images", "10", "--side", "224", "--route", "both"]


def missing() -> list[str]:
    """What the vision server cannot run without, in words."""
    out = []
    for module, why in (("numpy", "numpy"), ("PIL", "Pillow (image decoding)"), ("mlx.core", "mlx")):
        try:
            __import__(module)
        except ImportError as exc:
            out.append(f"{why}: {exc}")
    try:  # the processor vision/images.py loads (transformers 5, else 4)
        try:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil,  # noqa: F401
            )
        except ImportError:
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor  # noqa: F401
    except ImportError as exc:
        out.append(f"transformers' Qwen2-VL image processor: {exc}")
    return out


def main() -> int:
    out_dir = os.environ.get("OUT")
    lacking = missing()
    if lacking:
        message = "the vision benchmark cannot run here; missing: " + "; ".join(lacking)
        print(message, file=sys.stderr)
        if out_dir:
            Path(out_dir, "vision-gpu-error.json").write_text(json.dumps({"error": message}, indent=2) + "\n")
        return 2
    user = sys.argv[1:]
    given = {a for a in user if a.startswith("--")}
    args = [a for i in range(0, len(DEFAULTS), 2) if DEFAULTS[i] not in given for a in DEFAULTS[i:i + 2]]
    label = [] if "--label" in given else ["--label", "gpu-" + os.uname().nodename]
    cmd = [sys.executable, str(HERE.parent / "bench_vision.py"), *args, *label, *user]
    print(" ".join(cmd), flush=True)
    # Streamed, so a run cut short by the device's time limit still shows how far it got.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout or ():
        print(line, end="", flush=True)
        lines.append(line.strip())
    proc.wait()
    wrote = next((line.removeprefix("wrote ") for line in reversed(lines) if line.startswith("wrote ")), "")
    if out_dir and wrote and Path(wrote).exists():
        shutil.copy(wrote, out_dir)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
