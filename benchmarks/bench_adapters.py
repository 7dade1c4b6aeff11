"""What serving LoRA adapters per row costs (`--adapter NAME=DIR`, engine/adapters.py).

    python benchmarks/bench_adapters.py [--preset default] [--rows 8] [--prompt 128] [--tokens 64] [--rank 16] [--model DIR]

One engine core (the same one `mlxd serve` drives), prompt cache off. A batch of
`--rows` greedy rows (prompts of `--prompt` random tokens, `--tokens` generated
each) runs in four setups: no adapters loaded; two random adapters (every
linear of every layer, rank `--rank`, written by mlxd.model.lora) loaded but
every row on the base model; rows spread over base and both adapters in one
batch; every row on one adapter. Prints prefill and decode time and decode
tokens/s side by side, each as a ratio to the first setup. Results go to
benchmarks/results/adapters-*.json.

A second table times the model's decode forwards alone (same batch, no engine)
against mlx-lm's own LoRA layers (`mlx_lm.load(model, adapter_path=...)`, one
adapter for the whole batch): what a per-row adapter costs beside what LoRA
costs anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any


def _run(config: Any, prompts: list[tuple[int, ...]], rows_ns: list[str] | None, tokens: int) -> dict[str, float]:
    from mlxd.engine.core import EngineCore
    from mlxd.engine.drive import run_rows
    from mlxd.runtime.kernel.messages import GenerationRequest, SamplingParams

    core = EngineCore(config)
    info = core.load()
    ns = {a.name: a.namespace for a in info.adapters}
    names = rows_ns or [""] * len(prompts)
    requests = [
        GenerationRequest(request_id=f"r{i}", prompt=p, namespace=ns.get(names[i], ""),
                          sampling=SamplingParams(max_tokens=tokens, logit_bias=((0, -100.0),)))
        for i, p in enumerate(prompts)
    ]
    run = run_rows(core, requests)
    core.close()
    return {"prefill_s": run.all_started_s, "decode_s": run.seconds - run.all_started_s,
            "decode_tok_s": run.decode_tok_s()}


def _decode_forwards(model: Any, prompts: list[tuple[int, ...]], tokens: int, select: Any = None) -> float:
    """Decode tokens/s of `model` over the batch: one prefill, then `tokens` greedy forwards."""
    import contextlib

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    with select if select is not None else contextlib.nullcontext():
        cache = make_prompt_cache(model)
        nxt = mx.argmax(model(mx.array(prompts), cache=cache)[:, -1], axis=-1)
        mx.eval(nxt)
        t0 = time.perf_counter()
        for _ in range(tokens):
            nxt = mx.argmax(model(nxt[:, None], cache=cache)[:, -1], axis=-1)
            mx.eval(nxt)
        return len(prompts) * tokens / (time.perf_counter() - t0)


def _forward_table(model_dir: Path, pairs: tuple[tuple[str, str], ...], prompts: list[tuple[int, ...]],
                   tokens: int, repeat: int) -> list[tuple[str, float]]:
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxd.engine.adapters import install
    from mlxd.engine.loading import cast_float_weights

    def loaded(adapter: str | None = None) -> Any:
        model, _ = load(str(model_dir), adapter_path=adapter)
        if mx.default_device() == mx.cpu:
            cast_float_weights(model, mx.float32)  # as the engine does on CPU
        return model

    rows = len(prompts)
    plain, mlx_lm_one, model = loaded(), loaded(pairs[0][1]), loaded()
    served = install(model, pairs, reserved=("bench",))
    one, two = (served.index_of(a.namespace) for a in served.infos)
    setups = [
        ("plain model", plain, None),
        ("mlx-lm LoRA layers, adapter 'one'", mlx_lm_one, None),
        ("mlxd, all rows base", model, [0] * rows),
        ("mlxd, all rows 'one'", model, [one] * rows),
        ("mlxd, rows mixed base/one/two", model, [(0, one, two)[i % 3] for i in range(rows)]),
    ]
    best = [0.0] * len(setups)
    for _ in range(repeat):  # interleaved, best of each: this machine is shared
        for i, (_, m, indices) in enumerate(setups):
            best[i] = max(best[i], _decode_forwards(m, prompts, tokens, served.rows(indices) if indices else None))
    return [(label, rate) for (label, _, _), rate in zip(setups, best, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="default")
    parser.add_argument("--model", help="a local model directory instead of the preset (e.g. a GPU-sized one)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each setup, interleaved; the best is shown")
    parser.add_argument("--forwards-only", action="store_true", help="only the second table (model forwards)")
    args = parser.parse_args()

    import mlxd  # noqa: F401  (preloads OpenBLAS before MLX)
    from mlxd.model.lora import build_adapter
    from mlxd.model.tiny import ensure_model
    from mlxd.runtime.config import RuntimeConfig

    model_dir = Path(args.model) if args.model else Path(ensure_model(args.preset))
    rnd = random.Random(7)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [tuple(rnd.randrange(10, vocab - 10) for _ in range(args.prompt)) for _ in range(args.rows)]
    base = RuntimeConfig(model=str(model_dir), model_name="bench", prompt_cache_bytes=0, device_probe="off",
                         max_batch=args.rows, prefill_batch=args.rows, max_context=args.prompt + args.tokens + 8,
                         prefill_slice_s=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        pairs = tuple(
            (name, str(build_adapter(model_dir, Path(tmp) / name, seed=seed, rank=args.rank, magnitude=0.02)))
            for seed, name in ((1, "one"), (2, "two"))
        )
        import attrs

        adapted = attrs.evolve(base, adapters=pairs)
        mixed = [("", "one", "two")[i % 3] for i in range(args.rows)]
        setups = [
            ("no adapters loaded", base, None),
            ("2 loaded, all rows base", adapted, None),
            ("2 loaded, rows mixed base/one/two", adapted, mixed),
            ("2 loaded, all rows 'one'", adapted, ["one"] * args.rows),
        ]
        best: list[dict[str, float]] = [{} for _ in setups]
        for _ in range(0 if args.forwards_only else args.repeat):  # interleaved, best of each: a shared machine
            for i, (_, config, rows) in enumerate(setups):
                r = _run(config, prompts, rows, args.tokens)
                best[i] = {k: min(v, best[i].get(k, v)) if k != "decode_tok_s" else max(v, best[i].get(k, v))
                           for k, v in r.items()}
        results = [(label, b) for (label, _, _), b in zip(setups, best, strict=True) if b]
        forwards = _forward_table(model_dir, pairs, prompts, args.tokens, args.repeat)
    first = results[0][1] if results else {}
    print(f"{args.model or 'preset ' + args.preset}, {args.rows} rows x {args.prompt} prompt tokens, {args.tokens} generated, "
          f"LoRA rank {args.rank} on every linear layer")
    print(f"{'setup':36} {'prefill s':>10} {'decode s':>9} {'decode tok/s':>13} {'decode vs none':>15}")
    for label, r in results:
        print(f"{label:36} {r['prefill_s']:10.2f} {r['decode_s']:9.2f} {r['decode_tok_s']:13.1f} "
              f"{first['decode_tok_s'] / r['decode_tok_s']:14.2f}x")
    results_dir = Path(__file__).resolve().parent / "results"
    results_dir.mkdir(exist_ok=True)
    path = results_dir / f"adapters-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({
        "args": vars(args), "load_average": os.getloadavg(), "engine": dict(results),
        "forwards_tok_s": dict(forwards)}, indent=2))
    print()
    print(f"{'model decode forwards alone':36} {'tok/s':>10} {'time vs plain':>14} {'vs mlx-lm LoRA':>15}")
    for label, rate in forwards:
        print(f"{label:36} {rate:10.1f} {forwards[0][1] / rate:13.2f}x {forwards[1][1] / rate:14.2f}x")
    print(f"(wrote {path.name})")


if __name__ == "__main__":
    main()
