# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""Does the constrained path's token read cost a free decode? (issue 22), arms alternated in one runtime.

On the CPU the constrained path reads the step's input tokens (a sync on the previous
step's sample) before it queues the forward pass (`mx.async_eval`). This emulates that
order in a free decode, with no matchers: `free`; `free+read`: each row's processor
reads its input token (the forward pass is queued at the step's end, as free);
`free+ae`: each row's processor queues the forward pass; `free+read+ae`: the read,
then the forward pass queued (the constrained path's order on the CPU).

    PYTHONPATH=src python benchmarks/probe_constrained_sync.py [--rounds 7] [--batch 8 1]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.engine import features
from mlxd.model import ensure_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_structured import decode_rate  # noqa: E402

ARMS = ("free", "free+read", "free+ae", "free+read+ae")
MODE = ["free"]


def install_probe() -> None:
    """Every row gets one more logits processor that does what the arm in MODE says."""
    join = features.Sampling.join

    def joined(self: Any, row: Any, joining: Any) -> None:
        join(self, row, joining)

        def probe(tokens: Any, logits: Any) -> Any:
            if "read" in MODE[0]:
                tokens[-1:].tolist()  # the row's input token: the previous step's sample
            if MODE[0].endswith("+ae"):
                mx.async_eval(logits)
            return logits

        joining.processors.append(probe)

    features.Sampling.join = joined  # type: ignore[method-assign]


async def main(args: argparse.Namespace) -> None:
    install_probe()
    config = RuntimeConfig(model=str(ensure_model(args.preset)), max_batch=max(args.batch), device_probe="off")
    async with open_runtime(config) as rt:
        no_eos = tuple((t, -100.0) for t in sorted(rt.info.eos_token_ids))
        prompt = await rt.render_chat([{"role": "user", "content": "Write a long list of words."}])
        sampling = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1, logit_bias=no_eos)
        for arm in ARMS:  # warm
            MODE[0] = arm
            await decode_rate(rt, prompt, sampling, 1)
        for batch in args.batch:
            rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for r in range(args.rounds):
                for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
                    MODE[0] = arm
                    rates[arm].append(await decode_rate(rt, prompt, sampling, batch))
            print(f"batch {batch}: " + ", ".join(
                f"{arm} {statistics.median(v):.1f} tok/s "
                f"({statistics.median(x / f for x, f in zip(v, rates['free'], strict=True)):.3f}x)"
                for arm, v in rates.items()), flush=True)
    print(time.strftime("%H:%M:%S"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 1])
    trio.run(main, parser.parse_args())
