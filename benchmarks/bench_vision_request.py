"""What does a follow-up turn's request cost before the engine when it re-sends N images?

In-process, on the request path a chat follow-up takes before it reaches the
engine (the engine's part is bench_vision.py's): parse the JSON body (with
the lone-surrogate check), prepare the images (each one known from earlier
turns), widen the rendered ids into the media key, and check the spans. The
same follow-up with every image replaced by text of its span's length is
parsed alone. Thread CPU time, median of the repeats, so a loaded machine
changes it little; the client's JSON encoding of the body is shown beside.
Each repeat parses the body afresh (new strings: a URL's hash is not cached).

Also per image, the work a first sight costs and a known image skips: the
data: URL's base64 decode, a SHA-256 of its bytes (a file:// image's key),
Pillow's decode, the model's image processor and the digest of its patches.

With `--ssd`, each image's encoder output is on an SSD tier too (as a vision
server with `--ssd-cache` has it): the preparer reads and checks it once and
keeps it, against reading it for every request.

    python benchmarks/bench_vision_request.py [--images 10] [--side 224] [--repeats 20] [--ssd]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vision import image_turn, png  # noqa: E402

from mlxd.http.app import _parse_json  # noqa: E402
from mlxd.kv.media import check_spans  # noqa: E402
from mlxd.model import build_model  # noqa: E402
from mlxd.vision.images import ImageLimits, decode, read_url  # noqa: E402
from mlxd.vision.prepare import MediaPreparer, image_refs, restore_lifted  # noqa: E402


def cpu_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median thread CPU time of `fn`, in ms."""
    out = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        out.append((time.thread_time() - t0) * 1000)
    return statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench-vlm")
    p.add_argument("--images", type=int, default=10)
    p.add_argument("--side", type=int, default=224)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--ssd", action="store_true", help="encoder outputs on an SSD tier too")
    args = p.parse_args()
    model = build_model(Path(tempfile.mkdtemp()) / "vlm", args.preset, seed=0)
    prep = MediaPreparer.for_model(model, limits=ImageLimits(max_images=args.images), ssd_dir=None)
    assert prep is not None
    turns: list[dict[str, Any]] = [{"role": "system", "content": "You look at pictures."}]
    for i in range(args.images):
        turns += [image_turn(png(10 + i, args.side), f"Picture {i}?"), {"role": "assistant", "content": "A picture."}]
    turns.append({"role": "user", "content": "Which of these pictures was the brightest, and why?"})
    body = json.dumps({"messages": turns, "max_tokens": 1, "temperature": 0}).encode()
    refs = image_refs(turns)
    first = prep.prepare(refs)  # the earlier turns: every image processed once
    span = first[0][0].tokens
    text_turns = [{"role": m["role"], "content": " a" * span + " " + m["content"][-1]["text"]}
                  if isinstance(m["content"], list) else m for m in turns]
    text_body = json.dumps({"messages": text_turns, "max_tokens": 1, "temperature": 0}).encode()
    ids = [7] * 40 + sum(([9] + [7] * 12 for _ in range(args.images)), []) + [7] * 20  # 9: one placeholder each

    def image_path(lift: bool = True) -> None:
        raw, tokens = prep.lift(body) if lift else (body, {})
        messages = restore_lifted(_parse_json(raw), tokens)["messages"]
        images = prep.known(image_refs(messages))
        assert images is not None
        key, media = prep.widen([prep.placeholder if t == 9 else t for t in ids], images)
        assert check_spans(key, [m.span for m in media], 1 << 20) is None

    def known_fresh() -> None:
        refs = image_refs(_parse_json(body)["messages"])  # (parsed outside the timing below)
        t0 = time.thread_time()
        assert prep.known(refs) is not None
        known_ms.append((time.thread_time() - t0) * 1000)

    known_ms: list[float] = []

    r = args.repeats
    if args.ssd:
        import numpy as np

        from mlxd.vision.tensor_store import TensorPlan, write_plan

        ssd = Path(tempfile.mkdtemp())
        tensors = ssd / "tensors"
        for prepared, _ in first:
            hidden = json.loads((model / "config.json").read_text())["hidden_size"]
            write_plan(tensors, TensorPlan(prepared.digest, prep.identity,
                                           np.zeros((prepared.tokens, hidden), np.float32)))
        kept = MediaPreparer.for_model(model, limits=ImageLimits(max_images=args.images), ssd_dir=ssd)
        every = MediaPreparer.for_model(model, limits=ImageLimits(max_images=args.images), ssd_dir=ssd)
        assert kept is not None and every is not None
        every.max_features_bytes = 0  # nothing kept: every request reads and checks the files
        for one in (kept, every):
            one.prepare(refs)
        ssd_rows = {
            "prepare known images, SSD copies read each time": (cpu_ms(lambda: every.prepare(refs), r), 0.0),
            "prepare known images, SSD copies kept": (cpu_ms(lambda: kept.prepare(refs), r), 0.0),
        }
    for _ in range(r):
        known_fresh()
    lifted, tokens = prep.lift(body)
    url = turns[1]["content"][0]["image_url"]["url"]
    data = read_url(url, prep.limits)
    img = decode(data, prep.limits)
    rows = {
        "encode body (client)": (cpu_ms(lambda: json.dumps({"messages": turns}).encode(), r),
                                 cpu_ms(lambda: json.dumps({"messages": text_turns}).encode(), r)),
        "parse body (json.loads + checks)": (cpu_ms(lambda: _parse_json(body), r),
                                             cpu_ms(lambda: _parse_json(text_body), r)),
        "lift the known data: URLs (scan + compare)": (cpu_ms(lambda: prep.lift(body), r), 0.0),
        "parse the lifted body + put the URLs back": (
            cpu_ms(lambda: restore_lifted(_parse_json(lifted), tokens), r), 0.0),
        "known() on freshly parsed URLs (hashes them)": (statistics.median(known_ms), 0.0),
        "server path, no lift (parse, known, widen, check)": (cpu_ms(lambda: image_path(False), r),
                                                              cpu_ms(lambda: _parse_json(text_body), r)),
        "server path (lift, parse, known, widen, check)": (cpu_ms(image_path, r),
                                                           cpu_ms(lambda: _parse_json(text_body), r)),
        "first sight, per image: base64 decode": (cpu_ms(lambda: read_url(url, prep.limits), r), 0.0),
        "first sight, per image: SHA-256 of its bytes": (cpu_ms(lambda: hashlib.sha256(data).digest(), r), 0.0),
        "first sight, per image: Pillow decode": (cpu_ms(lambda: decode(data, prep.limits), r), 0.0),
        "first sight, per image: processor + digest": (cpu_ms(lambda: prep.processor.prepare(img, "auto"), r), 0.0),
    }
    print(f"{args.images} images of {args.side}x{args.side} px ({span} tokens each); body {len(body):,} bytes "
          f"vs {len(text_body):,} text-only; thread CPU ms, median of {r}:")
    print(f"  {'':52s} {'images':>8s} {'text':>8s}")
    if args.ssd:
        rows.update(ssd_rows)
    for name, (a, b) in rows.items():
        print(f"  {name:52s} {a:8.2f} {b:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
