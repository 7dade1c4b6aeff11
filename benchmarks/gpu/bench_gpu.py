"""mlxd on an accelerator: the measurements of issue #16, in one run, on one device.

    # on the CUDA host (see docs/benchmarks.md and ../shared/GPU.md for the install):
    python3 benchmarks/gpu/bench_gpu.py --out $OUT
    # here, to debug it on the CPU with a small model:
    python3 benchmarks/gpu/bench_gpu.py --small --out /tmp/gpu-bench

Phases (each one's results land in the JSON even when a later one fails):
1. build a random-weight bf16 model (Qwen3-1.7B shapes; --small: the `bench` shapes);
2. prefill: a plain MLX forward pass of the long prompt vs mlx-lm's BatchGenerator
   (what both servers run) at several chunk sizes;
3. the startup device probe (actors/device_probe.py, as `mlxd serve` runs it);
4. restore or recompute: for a grid of (prefix, suffix) sizes both arms are run
   (restore = cold read of a real snapshot file + adopt + suffix prefill;
   recompute = prefill of the whole prompt) and the probe-seeded advisor's choice
   is checked against the faster measured arm;
5. restore bandwidth: raw cold read, read_snapshot, adopt into MLX, first use;
6. RAM hit in-process: lend + insert + first token, piece by piece;
7. servers: `mlxd serve` vs `python3 -m mlx_lm server` on the same model: cold and
   RAM-hit TTFT, then mlxd restarted on its SSD tier (which arm it chose);
8. clean exit: N `mlxd serve` processes, each serves a request and gets SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import mlxd  # noqa: F401  (BLAS preload decision before mlx)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import mlx.core as mx  # noqa: E402

from mlxd.model import presets  # noqa: E402

QWEN3_1_7B = presets.ModelPreset(
    name="qwen3-1.7b-shape", vocab_size=8192, hidden_size=2048, num_hidden_layers=28,
    intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
)
QWEN3_8B = presets.ModelPreset(
    name="qwen3-8b-shape", vocab_size=8192, hidden_size=4096, num_hidden_layers=36,
    intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
)


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def run_streamed(args: list[str], *, result: str = "last", merge_stderr: bool = False) -> int:
    """Run a benchmark script, echoing its output as it comes (a run cut short by the device's time
    limit still shows how far it got), and copy the JSON it names into $OUT when set. `result`:
    "last" = its last line is the JSON's path; "wrote" = its last `wrote PATH` line names it."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else None,
                            text=True)
    lines = []
    for line in proc.stdout or ():
        print(line, end="", flush=True)
        lines.append(line.strip())
    proc.wait()
    if result == "wrote":
        path = next((line.removeprefix("wrote ") for line in reversed(lines) if line.startswith("wrote ")), "")
    else:
        path = next((line for line in reversed(lines) if line), "")
    out = os.environ.get("OUT")
    if out and path.endswith(".json") and Path(path).exists():
        shutil.copy(path, out)
    return proc.returncode


# --- 1. the model ------------------------------------------------------------------------


def build(preset: presets.ModelPreset, dest: Path, *, seed: int = 0) -> Path:
    from mlxd.model.tiny import build_model

    presets.PRESETS[preset.name] = preset
    t0 = time.perf_counter()
    build_model(dest, preset.name, seed=seed)
    weights = mx.load(str(dest / "model.safetensors"))
    weights = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = json.loads((dest / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    log(f"built {preset.name} in {time.perf_counter() - t0:.1f}s")
    return dest


def built(preset: presets.ModelPreset, work: Path) -> Path:
    """`work/model-NAME`, built once (into a `.partial` folder renamed when whole) and reused after."""
    model_dir = work / f"model-{preset.name}"
    if not (model_dir / "config.json").exists():
        tmp = work / f"model-{preset.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        build(preset, tmp)
        tmp.rename(model_dir)
        gc.collect()
        mx.clear_cache()  # the build's buffers: a bench's servers share this device (6 GB on the 1.7B shape)
    return model_dir


def probe_options(ap: argparse.ArgumentParser, out: Path, *, work_help: str = "where the model is built") -> None:
    """A one-process probe's common options: `--small` (the `bench` preset: a CPU check), `--out`, `--work`."""
    ap.add_argument("--small", action="store_true", help="the `bench` preset (CPU check)")
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--work", type=Path, default=Path("/tmp/host-servers-work"), help=work_help)


def probe_model(args: argparse.Namespace) -> tuple[presets.ModelPreset, Path]:
    """The probe's preset (`--small`: `bench`, else the 1.7B shape) and its model, built once under `--work`;
    `--out` and `--work` made."""
    preset = presets.PRESETS["bench"] if args.small else QWEN3_1_7B
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    return preset, built(preset, args.work)


def load(model_dir: Path) -> tuple[Any, Any]:
    from mlxd.engine.loading import cast_float_weights
    from mlxd.model.detok import load_model

    model, tok = load_model(model_dir)
    if mx.default_device() == mx.cpu:
        cast_float_weights(model, mx.float32)  # as the engine does on CPU
    return model, tok


def tokens(n: int, seed: int, vocab: int = 8192) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def generator(model: Any, step: int) -> Any:
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(model, max_tokens=8, stop_tokens=[], prefill_step_size=step)


def first_token(gen: Any, prompt: list[int], caches: list[Any] | None = None, all_tokens: list[int] | None = None) -> float:
    """Insert a row and step until its first generated token: seconds."""
    t0 = time.perf_counter()
    (uid,) = gen.insert(
        [list(prompt)], max_tokens=[1], caches=[caches] if caches is not None else None,
        all_tokens=[list(all_tokens)] if all_tokens is not None else None,
    )
    while True:
        _, out = gen.next()
        if any(r.uid == uid for r in out):
            return time.perf_counter() - t0  # max_tokens=1: the row has left the batch


def cache_for(gen: Any, prompt: list[int]) -> list[Any]:
    """The KV cache after `prompt` (plus one generated token), evaluated."""
    (uid,) = gen.insert([prompt], max_tokens=[1])
    caches: list[Any] = []
    while not caches:
        _, out = gen.next()
        for r in out:
            if r.uid == uid and r.finish_reason is not None:
                caches = list(r.prompt_cache)
    mx.eval([c.state for c in caches])
    return caches


# --- 2. prefill ------------------------------------------------------------------------------


def phase_prefill(model: Any, n: int, steps: list[int]) -> dict[str, Any]:
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.model import fast_mask

    out: dict[str, Any] = {"tokens": n}
    prompt = mx.array(tokens(n, 1))[None]

    def chunked(step: int, *, prealloc: bool = False, clear: bool = False) -> float:
        cache = make_prompt_cache(model)
        if prealloc:
            for c in cache:
                c.step = n  # one allocation per layer instead of one per chunk
        mx.synchronize()
        t0 = time.perf_counter()
        for s in range(0, n, step):
            logits = model(prompt[:, s : s + step], cache=cache)
            mx.eval(logits[:, -1, :], [c.state for c in cache])
            if clear:
                mx.clear_cache()  # as mlx-lm's BatchGenerator does after each chunk
        return time.perf_counter() - t0

    chunked(n)  # warm-up
    out["plain_forward_s"] = [chunked(n) for _ in range(2)]
    out["plain_chunked_s"] = {step: chunked(step) for step in steps}
    out["plain_chunked_2048_prealloc_s"] = chunked(2048, prealloc=True)
    out["plain_chunked_2048_clear_cache_s"] = chunked(2048, clear=True)
    out["plain_chunked_2048_prealloc_clear_s"] = chunked(2048, prealloc=True, clear=True)
    for label, patched in (("batch_generator_mlx_lm_mask_s", False), ("batch_generator_fast_mask_s", True)):
        (fast_mask.install if patched else fast_mask.uninstall)()
        for step in steps:
            gen = generator(model, step)
            first_token(gen, tokens(min(n, 4096), 2))  # warm-up
            out.setdefault(label, {})[step] = [first_token(gen, tokens(n, 3 + r)) for r in range(2)]
            gen.close()
            mx.clear_cache()
    fast_mask.install()
    log("prefill", json.dumps(out))
    return out


# --- 3. the probe ------------------------------------------------------------------------------


def phase_probe(model: Any, ssd: Path, budget: float, vocab: int, kv_per_token: int) -> Any:
    from mlxd.actors.device_probe import probe_device

    gen = generator(model, 2048)
    probe = probe_device(
        gen, vocab_size=vocab, max_context=40960, kv_bytes_per_token=kv_per_token, budget_s=budget,
        restore_dir=ssd, tune_step=mx.default_device() != mx.cpu,
    )
    gen.close()
    log("probe", json.dumps(probe.as_dict()))
    return probe


# --- 4. restore or recompute ---------------------------------------------------------------------


def write_file(caches: list[Any], path: Path, n: int) -> int:
    from mlxd.kv import file_format, kinds

    meta = file_format.SnapshotMeta(
        model_id="bench", config_fingerprint="bench", namespace="", tokenizer_hash="bench", tokens=range(n)
    )
    plan = kinds.plan_snapshot(caches, meta=meta)
    return file_format.write_snapshot(plan, path, direct=False).nbytes


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def restore_arm(gen: Any, path: Path, prefix: list[int], suffix: list[int]) -> dict[str, float]:
    """What serving does on an SSD hit: read (prefetcher), adopt + lend (engine), prefill the suffix."""
    from mlxd.kv import file_format, kinds

    drop_cache(path)
    t0 = time.perf_counter()
    loaded = file_format.read_snapshot(path, verify=False)
    t1 = time.perf_counter()
    caches = kinds.adopt(loaded)
    t2 = time.perf_counter()
    lent = kinds.lend(caches, len(prefix))
    ttft = first_token(gen, suffix, lent, prefix)
    total = time.perf_counter() - t0
    return {"read_s": t1 - t0, "adopt_s": t2 - t1, "suffix_s": ttft, "total_s": total}


def phase_arms(model: Any, probe: Any, ssd: Path, prefixes: list[int], suffixes: list[int], step: int) -> dict[str, Any]:
    from mlxd.kv.restore_decision import RestoreAdvisor

    gen = generator(model, step)
    first_token(gen, tokens(256, 2))
    advisor = RestoreAdvisor(base=probe.cost_model())
    rows = []
    for p in prefixes:
        prefix = tokens(p, 100 + p)
        path = ssd / f"arm-{p}.mlxkv"
        nbytes = write_file(cache_for(gen, prefix), path, p)
        mx.clear_cache()
        for s in suffixes:
            suffix = tokens(s, 200 + s + p)
            r = restore_arm(gen, path, prefix, suffix)
            recompute = first_token(gen, prefix + suffix)
            choice = advisor.should_restore(restore_bytes=nbytes, cold_tokens=p, warm_tokens=0, prompt_tokens=p + s)
            faster = "restore" if r["total_s"] < recompute else "recompute"
            row = {
                "prefix": p, "suffix": s, "file_bytes": nbytes, "restore": r, "recompute_s": recompute,
                "predicted_restore_s": advisor.restore_seconds(nbytes) + advisor.prefill_seconds(s, p),
                "predicted_recompute_s": advisor.prefill_seconds(p + s, 0),
                "advisor": "restore" if choice else "recompute", "faster": faster,
            }
            row["right"] = row["advisor"] == faster
            chosen = r["total_s"] if choice else recompute
            row["regret_s"] = chosen - min(r["total_s"], recompute)
            rows.append(row)
            log(
                f"arms P={p} S={s}: restore {r['total_s']:.3f}s (read {r['read_s']:.3f} adopt {r['adopt_s']:.3f}) "
                f"recompute {recompute:.3f}s -> advisor {row['advisor']} ({'right' if row['right'] else 'WRONG'})"
            )
        path.unlink()
    gen.close()
    right = sum(r["right"] for r in rows)
    return {"rows": rows, "right": right, "total": len(rows), "fraction_right": right / max(1, len(rows))}


# --- 5. restore bandwidth -----------------------------------------------------------------------


def phase_bandwidth(model: Any, ssd: Path, n: int) -> dict[str, Any]:
    import mmap

    import numpy as np

    from mlxd.kv import file_format, kinds

    gen = generator(model, 2048)
    path = ssd / "bw.mlxkv"
    nbytes = write_file(cache_for(gen, tokens(n, 7)), path, n)
    gen.close()
    out: dict[str, Any] = {"tokens": n, "file_bytes": nbytes}
    # Raw: one page-aligned buffer, large reads, cold.
    drop_cache(path)
    buf = mmap.mmap(-1, nbytes)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        pos = 0
        while pos < nbytes:
            got = f.readinto(view[pos : pos + (64 << 20)])
            if not got:
                break
            pos += got
    out["raw_cold_read_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
    # Warm: the same from the page cache.
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < nbytes:
            pos += f.readinto(view[pos : pos + (64 << 20)]) or nbytes
    out["raw_warm_read_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
    # Host to MLX: one array from the host buffer, evaluated (the adopt copy's limit).
    host = np.frombuffer(buf, dtype=np.uint16)
    for _ in range(2):
        t0 = time.perf_counter()
        a = mx.array(memoryview(host))
        mx.eval(a)
        out["host_to_mlx_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        mx.eval(a.sum())
        out["first_use_sum_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
        del a
    # Straight into MLX memory: read into an evaluated array's own buffer (no host copy).
    for label, cold in (("cold", True), ("warm", False)):
        if cold:
            drop_cache(path)
        t0 = time.perf_counter()
        dst = mx.zeros((nbytes,), dtype=mx.uint8)
        mx.eval(dst)
        mx.synchronize()
        t1 = time.perf_counter()
        try:
            target = np.array(dst, copy=False)
            with open(path, "rb", buffering=0) as f:
                view = memoryview(target)
                pos = 0
                while pos < nbytes:
                    got = f.readinto(view[pos : pos + (64 << 20)])
                    if not got:
                        break
                    pos += got
            t2 = time.perf_counter()
            check = int(dst[: 1 << 20].astype(mx.uint32).sum().item())
            t3 = time.perf_counter()
            out[f"direct_into_mlx_{label}"] = {
                "alloc_s": t1 - t0, "read_GBps": nbytes / (t2 - t1) / 1e9, "first_use_s": t3 - t2,
                "total_GBps": nbytes / (t3 - t0) / 1e9,
                "bytes_match": check == int(np.frombuffer(buf, dtype=np.uint8, count=1 << 20).astype(np.uint64).sum()),
            }
        except Exception as exc:  # the backend may not expose its memory
            out[f"direct_into_mlx_{label}"] = {"error": f"{type(exc).__name__}: {exc}"}
        del dst
    # The serving path: read_snapshot (cold), then adopt, then a first use on the device.
    for label, cold in (("cold", True), ("warm", False)):
        if cold:
            drop_cache(path)
        t0 = time.perf_counter()
        loaded = file_format.read_snapshot(path, verify=False)
        t1 = time.perf_counter()
        caches = kinds.adopt(loaded)
        t2 = time.perf_counter()
        mx.eval([c.keys.sum() for c in caches])
        t3 = time.perf_counter()
        out[f"read_snapshot_{label}_GBps"] = nbytes / (t1 - t0) / 1e9
        out[f"adopt_{label}_GBps"] = nbytes / (t2 - t1) / 1e9
        out[f"restore_{label}_GBps"] = nbytes / (t2 - t0) / 1e9
        out[f"first_use_{label}_s"] = t3 - t2
        del caches, loaded
    # The serving path on CUDA now: read straight into MLX arrays (kinds.landing), pages moved to the device.
    from mlxd.runtime import device_memory

    for label, cold in (("cold", True), ("warm", False)):
        if cold:
            drop_cache(path)
        t0 = time.perf_counter()
        loaded = file_format.read_snapshot(path, verify=False, land=kinds.landing)
        t1 = time.perf_counter()
        caches = kinds.adopt(loaded, landed=device_memory.to_device)
        t2 = time.perf_counter()
        mx.eval([c.keys.sum() for c in caches])
        t3 = time.perf_counter()
        out[f"landed_read_{label}_GBps"] = nbytes / (t1 - t0) / 1e9
        out[f"landed_restore_{label}_GBps"] = nbytes / (t2 - t0) / 1e9
        out[f"landed_first_use_{label}_s"] = t3 - t2
        out[f"landed_to_first_use_{label}_GBps"] = nbytes / (t3 - t0) / 1e9
        del caches, loaded
    out["managed_memory"] = device_memory.managed() is not None
    # The previous path (read-through + mmap views), for comparison.
    drop_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        scratch = memoryview(bytearray(8 << 20))
        while f.readinto(scratch):
            pass
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    header = file_format.read_header(path)
    arrays = [
        mx.array(memoryview(np.frombuffer(mapping, dtype=np.uint16, count=t.nbytes // 2, offset=t.offset)))
        for _, t in header.tensors()
    ]
    mx.eval(arrays)
    out["old_mmap_path_cold_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
    del arrays
    path.unlink()
    log("bandwidth", json.dumps(out))
    return out


# --- 6. RAM hit in-process -------------------------------------------------------------------------


def phase_ram_hit(model: Any, n: int, step: int) -> dict[str, Any]:
    from mlxd.kv import kinds

    gen = generator(model, step)
    first_token(gen, tokens(256, 2))
    out: dict[str, Any] = {"tokens": n, "runs": []}
    for r in range(3):
        prompt = tokens(n, 300 + r)
        cold = first_token(gen, prompt)
        entry = cache_for(gen, prompt)
        t0 = time.perf_counter()
        lent = kinds.lend(entry, n - 1)
        t1 = time.perf_counter()
        hit = first_token(gen, prompt[n - 1 :], lent, prompt[: n - 1])
        out["runs"].append({"cold_s": cold, "lend_s": t1 - t0, "hit_first_token_s": hit})
    gen.close()
    log("ram_hit", json.dumps(out))
    return out


# --- 7. servers -----------------------------------------------------------------------------------


class Proc:
    def __init__(self, name: str, cmd: list[str], port: int, ready: str, logpath: Path) -> None:
        self.name, self.cmd, self.port, self.ready, self.logpath = name, cmd, port, ready, logpath
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 240) -> float:
        import httpx

        t0 = time.perf_counter()
        with open(self.logpath, "ab") as fh:
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.logpath.read_text()[-3000:]}")
            try:
                if httpx.get(self.base + self.ready, timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.name)

    def stop(self, timeout: float = 90) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


async def ttft(base: str, model: str, prompt: str | list[dict[str, str]], max_tokens: int = 4) -> dict[str, Any]:
    import httpx

    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {
        "model": model, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    first = None
    usage: dict[str, Any] = {}
    # The client object first, outside the clock: httpx builds an SSL context for it (certifi's bundle), 0.14-0.2 s
    # on a loaded 2-core host, the same for every server, that compressed the servers' ratios toward 1. The
    # connection (a new one each turn), the body's encoding and the server's reply stay inside.
    async with httpx.AsyncClient(timeout=None) as client:
        t0 = time.perf_counter()
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                usage = obj.get("usage") or usage
                for ch in obj.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    # t0 and first: this process's perf_counter, the server's clock too on one host (its request.http `arrived`)
    return {"ttft_s": (first or time.perf_counter()) - t0, "t0": t0, "first": first,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"), "text": "".join(text)}


def text_of(model_dir: Path, n: int, seed: int) -> str:
    from bench_serving import TextMaker

    return TextMaker(model_dir).make(seed, n)


def done_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if ('"request.done"' in line or '"request.http"' in line or '"engine.device_probe"' in line
                or '"restore' in line):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def phase_servers(model_dir: Path, work: Path, n: int, repeats: int) -> dict[str, Any]:
    mlxd_cmd = [sys.executable, "-m", "mlxd.cli", "serve", "--model", str(model_dir), "--port", "18180",
                "--log-format", "json", "--prompt-cache-gb", "40", "--ssd-cache", str(work / "ssd-serve")]
    lm_cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", "18181",
              "--log-level", "WARNING"]
    ram_cmd = [*mlxd_cmd[: mlxd_cmd.index("--ssd-cache")], "--port", "18182"]  # RAM tier only
    servers = [
        Proc("mlxd", mlxd_cmd, 18180, "/health", work / "mlxd.log"),
        Proc("mlxd_ram", ram_cmd, 18182, "/health", work / "mlxd_ram.log"),
        Proc("mlx_lm", lm_cmd, 18181, "/v1/models", work / "mlx_lm.log"),
    ]
    prompts = [text_of(model_dir, n, 500 + i) for i in range(repeats)]
    out: dict[str, Any] = {"tokens": n, "commands": {s.name: " ".join(s.cmd) for s in servers}}
    for s in servers:
        model = "default_model" if s.name == "mlx_lm" else model_dir.name
        rows = []
        try:
            out[f"{s.name}_start_s"] = s.start()
            asyncio.run(ttft(s.base, model, "warm up " * 20))
            for p in prompts:
                cold = asyncio.run(ttft(s.base, model, p))
                hit = asyncio.run(ttft(s.base, model, p))
                # The next turn of that conversation: its reply and a new question appended.
                turn2 = [{"role": "user", "content": p}, {"role": "assistant", "content": hit["text"]},
                         {"role": "user", "content": "Say more about the last part, briefly."}]
                follow = asyncio.run(ttft(s.base, model, turn2))
                rows.append({"cold": cold, "hit": hit, "followup": follow})
                log(s.name, f"cold {cold['ttft_s']:.3f}s hit {hit['ttft_s']:.3f}s cached {hit['cached_tokens']} "
                            f"follow-up {follow['ttft_s']:.3f}s cached {follow['cached_tokens']}")
            if s.name == "mlxd":
                import httpx

                out["mlxd_stats"] = httpx.get(s.base + "/stats", timeout=30).json()
                out["mlxd_flush"] = httpx.post(s.base + "/admin/cache/flush", timeout=600).json()
        except Exception as exc:  # keep what was measured
            out[f"{s.name}_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            out[f"{s.name}_exit_code"] = s.stop()
            out[f"{s.name}_rows"] = rows
    out["mlxd_log"] = done_lines(work / "mlxd.log")
    out["mlxd_ram_log"] = done_lines(work / "mlxd_ram.log")
    # Restart on the SSD tier: which arm does the probe-seeded advisor choose, and how fast?
    again = Proc("mlxd-restart", mlxd_cmd, 18180, "/health", work / "mlxd-restart.log")
    try:
        out["restart_start_s"] = again.start()
        out["restart_rows"] = [asyncio.run(ttft(again.base, model_dir.name, p)) for p in prompts]
        import httpx

        out["restart_stats"] = httpx.get(again.base + "/stats", timeout=30).json()
    except Exception as exc:
        out["restart_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        out["restart_exit_code"] = again.stop()
    out["restart_log"] = done_lines(work / "mlxd-restart.log")
    return out


# --- 8. clean exit ----------------------------------------------------------------------------------


def phase_exit(model_dir: Path, work: Path, n: int) -> dict[str, Any]:
    codes = []
    aborts = 0
    for i in range(n):
        logpath = work / f"exit-{i}.log"
        p = Proc("mlxd", [sys.executable, "-m", "mlxd.cli", "serve", "--model", str(model_dir), "--port", "18182",
                          "--log-format", "json"], 18182, "/health", logpath)
        try:
            p.start()
            asyncio.run(ttft(p.base, model_dir.name, "hello " * 50, max_tokens=8))
        except Exception as exc:
            log("exit run failed", exc)
        code = p.stop()
        codes.append(code)
        aborts += "terminate called" in logpath.read_text(errors="replace")
        log(f"exit {i}: code {code}")
    return {"runs": n, "exit_codes": codes, "zero": sum(c == 0 for c in codes), "aborts_logged": aborts}


# --- main ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="small model and sizes (CPU debugging)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-bench")))
    ap.add_argument("--work", type=Path, default=None, help="scratch dir (models, SSD files)")
    ap.add_argument("--phases", default="prefill,probe,arms,bandwidth,ramhit,servers,exit")
    ap.add_argument("--exit-runs", type=int, default=6)
    ap.add_argument("--keep-work", action="store_true", help="keep --work (and reuse a model built there)")
    ap.add_argument("--model-8b", action="store_true", help="also the 8B-shaped model (prefill + arms only)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="mlxd-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ssd = work / "ssd"
    ssd.mkdir(exist_ok=True)
    small = args.small
    preset = presets.PRESETS["default"] if small else QWEN3_1_7B
    long_n = 1024 if small else 16384
    prefixes = [256, 1024] if small else [1024, 4096, 8192, 16384, 32768]
    suffixes = [16, 512] if small else [64, 1024, 4096]
    steps = [512, 1024] if small else [2048, 4096, 8192, 16384]
    phases = set(args.phases.split(","))
    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "argv": sys.argv,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "blas": dict(mlxd._blas.status),
        "preset": {k: getattr(preset, k) for k in ("name", "hidden_size", "num_hidden_layers", "intermediate_size",
                                                   "num_attention_heads", "num_key_value_heads", "head_dim")},
        "dtype": "bfloat16 weights" + (" (cast to fp32 on CPU)" if mx.default_device() == mx.cpu else ""),
    }
    try:
        result["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        result["gpu"] = None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path = args.out / f"gpu-{'small-' if small else ''}{stamp}.json"

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=1, default=str) + "\n")

    def run(name: str, fn: Any) -> Any:
        if name not in phases:
            return None
        t0 = time.perf_counter()
        try:
            value = fn()
            result[name] = value.as_dict() if hasattr(value, "as_dict") else value
            return value
        except Exception as exc:
            result[f"{name}_error"] = traceback.format_exc()
            log(f"{name} failed: {exc}")
            return None
        finally:
            result.setdefault("phase_seconds", {})[name] = round(time.perf_counter() - t0, 2)
            save()

    built = work / "model" / "config.json"
    model_dir = work / "model" if args.keep_work and built.exists() else build(preset, work / "model")
    model, _ = load(model_dir)
    from mlxd.model import fast_mask

    fast_mask.install()  # as the engine does (phase "prefill" also measures without it)
    kv_per_token = preset.num_hidden_layers * preset.num_key_value_heads * preset.head_dim * 2 * (
        4 if mx.default_device() == mx.cpu else 2
    )
    run("prefill", lambda: phase_prefill(model, long_n, steps))
    probe = run("probe", lambda: phase_probe(model, ssd, 3.0, preset.vocab_size, kv_per_token))
    step = probe.prefill_step_size if probe is not None else 2048
    if probe is not None:
        run("arms", lambda: phase_arms(model, probe, ssd, prefixes, suffixes, step))
    run("bandwidth", lambda: phase_bandwidth(model, ssd, long_n))
    run("ramhit", lambda: phase_ram_hit(model, long_n, step))
    del model
    mx.clear_cache()
    run("servers", lambda: phase_servers(model_dir, work, long_n, 5))
    run("exit", lambda: phase_exit(model_dir, work, args.exit_runs))
    if args.model_8b and not small:
        big = build(QWEN3_8B, work / "model-8b")
        model, _ = load(big)
        kv8 = QWEN3_8B.num_hidden_layers * QWEN3_8B.num_key_value_heads * QWEN3_8B.head_dim * 2 * 2
        run("prefill_8b", lambda: phase_prefill(model, long_n, [2048, 8192]))
        probe8 = run("probe_8b", lambda: phase_probe(model, ssd, 3.0, QWEN3_8B.vocab_size, kv8))
        if probe8 is not None:
            run("arms_8b", lambda: phase_arms(model, probe8, ssd, [4096, 16384], [64, 4096], probe8.prefill_step_size))
    save()
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    log("wrote", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
