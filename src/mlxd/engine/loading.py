"""Loading a model for the engine core: weights, shards, identity, KV scheme, memory budget.

Every function here runs on the engine's MLX thread, inside its stream.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import attrs

from mlxd.engine.ops import ModelRefused
from mlxd.kv.ssd_store import StoreIdentity
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.distributed import StepChannel
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.engine")


@attrs.frozen(eq=False)
class Loaded:
    """A loaded model and what was read beside it."""

    path: Path
    model: Any
    tokenizer: Any
    config: dict[str, Any]  # the model's config.json
    channel: StepChannel | None  # --distributed: this rank's step channel


def resolve_model_path(config: RuntimeConfig) -> Path:
    if config.model is None:
        from mlxd.model.tiny import ensure_model

        return Path(ensure_model(config.model_preset))
    local = local_model_path(config.model)
    if local is not None:
        return local
    from mlx_lm.utils import _download  # hub repo id, where a network exists

    try:
        return Path(_download(config.model))
    except Exception as exc:  # a malformed id, no such repo, no network: the reason, not a traceback
        raise ModelRefused(f"--model {config.model}: not a local directory, and not fetched as a Hugging Face "
                           f"repo id ({type(exc).__name__}: {exc})") from exc


def local_model_path(model: str) -> Path | None:
    """`--model` as a local directory, None where it names a Hub repo id; a path that is not there is refused
    (`mlxd serve` checks this before its imports, so a typo is refused at once)."""
    local = Path(model).expanduser()
    if local.exists():
        return local
    if model.startswith(("/", "~", ".")):  # a path, never a repo id
        raise ModelRefused(f"--model {model}: no such directory")
    return None


def load(config: RuntimeConfig, stream: Any) -> Loaded:
    """The model of `config` (this rank's shard when distributed), float weights in fp32 on CPU."""
    import mlx.core as mx

    from mlxd.model.detok import load_model

    path = resolve_model_path(config)
    extra = {"tokenizer_config": {"chat_template": _chat_template(config)}} if config.chat_template else {}
    channel = None
    if config.distributed:
        group = _distributed_group()
        channel = StepChannel(group, stream)
        model, tokenizer = load_model(path, lazy=True, **extra)
        _shard(model, path, group)
        log.info(
            "engine.distributed", rank=group.rank(), world_size=group.size(), pid=os.getpid(),
            sharding="tensor-parallel",
            prompt_cache=("off" if config.prompt_cache_bytes <= 0
                          else "ram, mirrored: every rank keeps its shard of each cached prefix"),
        )
    else:
        model, tokenizer = load_model(path, **extra)
    if config.chat_template:
        _check_template(tokenizer, config.chat_template)
    if mx.default_device() == mx.cpu:
        cast_float_weights(model, mx.float32)  # bf16/fp16 matmuls are far slower than fp32 on CPU
    if channel is not None:
        channel.connect()  # every rank has loaded its shard
        log.info("engine.step_channel", rank=channel.rank, mode=channel.mode)
    return Loaded(path, model, tokenizer, json.loads((path / "config.json").read_text()), channel)


def _chat_template(config: RuntimeConfig) -> str:
    """--chat-template FILE's text (the tokenizer renders chats with it instead of the model's)."""
    assert config.chat_template is not None
    try:
        return Path(config.chat_template).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelRefused(f"--chat-template {config.chat_template}: cannot read it ({exc})") from exc


def _check_template(tokenizer: Any, path: str) -> None:
    """--chat-template FILE must be valid Jinja: with a syntax error every chat request would fail (400)."""
    from jinja2 import TemplateSyntaxError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    except TemplateSyntaxError as exc:
        raise ModelRefused(f"--chat-template {path}: not a valid Jinja template (line {exc.lineno}: {exc.message})") \
            from exc
    except Exception:  # noqa: S110 - a template may refuse this conversation; each request then says why
        pass


def _distributed_group() -> Any:
    import mlx.core as mx

    try:
        return mx.distributed.init(strict=True)
    except RuntimeError as exc:
        raise ModelRefused(
            f"--distributed needs the ranks of a distributed launch (e.g. `mlx.launch --backend ring "
            f"-n 2 --hosts 127.0.0.1 -- mlxd serve --distributed ...`): {exc}"
        ) from exc


def _shard(model: Any, path: Path, group: Any) -> None:
    """Keep this rank's shard: mlx-lm's tensor parallelism (`model.shard`)."""
    if group.size() == 1:
        return
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = [cfg.get(k) for k in ("num_attention_heads", "num_key_value_heads")]
    if any(isinstance(h, int) and h % group.size() for h in heads):
        raise ModelRefused(f"cannot shard {path} over {group.size()} ranks: attention heads {heads} do not divide evenly")
    if not hasattr(model, "shard"):
        raise ModelRefused(f"cannot serve {path} distributed: its mlx-lm model class has no tensor-parallel shard()")
    try:
        model.shard(group)
    except ValueError as exc:  # e.g. heads not divisible by the world size
        raise ModelRefused(f"cannot shard {path} over {group.size()} ranks: {exc}") from exc


# Names that already mean the served model in requests (the HTTP layer's MODEL_ALIASES).
MODEL_ALIASES = ("default", "default_model")


def adapters(model: Any, config: RuntimeConfig) -> Any:
    """--adapter: every LoRA adapter applied to `model`, each row selecting its own (engine/adapters.py)."""
    from mlxd.engine.adapters import install

    return install(model, config.adapters, reserved=(served_name(config), *MODEL_ALIASES))


def served_name(config: RuntimeConfig) -> str:
    if config.model_name:
        return config.model_name
    if config.model and Path(config.model).exists():
        return Path(config.model).name
    return config.model or f"mlxd-{config.model_preset}"


def fresh_caches(model: Any, config: RuntimeConfig) -> list[Any]:
    """A new row's caches: the model's own, with plain KV layers quantized under --kv-bits."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.kv.quantized_batch import quantized_like

    caches = make_prompt_cache(model)
    if config.kv_bits is None:
        return caches
    return quantized_like(caches, group_size=config.kv_group_size, bits=config.kv_bits)


def trimmable(model: Any, config: RuntimeConfig) -> bool:
    """Whether this model's caches can be cut back to a shorter prefix (plain attention can; recurrent can't)."""
    from mlxd.kv import kinds

    return kinds.is_trimmable(fresh_caches(model, config))


def has_windows(model: Any, config: RuntimeConfig) -> bool:
    """Whether any layer (inside CacheLists too) keeps a sliding window (mlx-lm's RotatingKVCache)."""
    from mlx_lm.models.cache import CacheList, RotatingKVCache

    def windowed(c: Any) -> bool:
        if type(c) is CacheList:
            return any(windowed(x) for x in c.caches)
        return isinstance(c, RotatingKVCache)

    return any(windowed(c) for c in fresh_caches(model, config))


def check_caches(model: Any, config: RuntimeConfig, path: Path) -> int:
    """Refuse a model whose caches cannot be served; return the KV bytes one more token costs."""
    from mlxd.kv import kinds

    try:  # unsupported caches fail the load, not the first request or cache hit
        kinds.check_model_caches(fresh_caches(model, config))
    except kinds.UnknownCacheKind as exc:
        raise ModelRefused(f"cannot serve {path}: {exc}") from exc
    return kv_bytes_per_token(model, config, path)


def kv_bytes_per_token(model: Any, config: RuntimeConfig, path: Path) -> int:
    """Cache bytes one more token of context costs, all layers, under the KV scheme (two short prefills)."""
    import mlx.core as mx

    from mlxd.kv import kinds

    sizes = []
    for n in (32, 64):
        caches = fresh_caches(model, config)
        try:
            model(mx.zeros((1, n), dtype=mx.int32), cache=caches)
            mx.eval([c.state for c in caches])
        except Exception as exc:
            raise ModelRefused(_prefill_failure(path, config, exc)) from exc
        sizes.append(kinds.nbytes(caches))
    return max(0, (sizes[1] - sizes[0]) // 32)


def _prefill_failure(path: Path, config: RuntimeConfig, exc: Exception) -> str:
    """Name the KV scheme only when one is set: a model that fails a plain prefill has another problem."""
    what = f"{type(exc).__name__}: {exc}"
    if config.kv_bits is None:
        return f"cannot serve {path}: the load-time test prefill failed ({what})"
    return (
        f"cannot serve {path}: this model cannot run KV scheme {config.kv_scheme} (--kv-bits {config.kv_bits}; "
        f"the load-time test prefill failed: {what}); start without --kv-bits"
    )


def memory_budget(config: RuntimeConfig) -> int:
    """--memory-budget, or a share of the device's memory (runtime.config.default_memory_budget)."""
    import mlx.core as mx

    from mlxd.runtime.config import default_memory_budget, physical_memory_bytes

    if config.memory_budget_bytes is not None:
        return config.memory_budget_bytes
    if hasattr(mx, "device_info"):
        info = dict(mx.device_info())
    elif mx.metal.is_available():
        info = dict(mx.metal.device_info())
    else:
        info = {}
    return default_memory_budget(info, physical_memory_bytes())


# MLX's buffer cache (freed buffers kept for reuse) at most this share of the memory budget (keep_buffer_cache_to).
BUFFER_CACHE_SHARE = 1 / 8


def keep_buffer_cache_to(budget: int) -> tuple[int, int] | None:
    """MLX's buffer-cache limit set to a share of the memory budget (> 0): (the limit now, MLX's before); None
    without a budget.

    MLX keeps freed buffers for reuse and, by default, lets them add up to its memory limit (95 % of the device's
    memory on CUDA) before it frees any. The budget's relief acts on active memory (the RAM tier's arrays), never
    on that cache: with MLX's default a server held up to 51.8 GiB of an H100 beside a 3 GiB RAM tier, and three
    servers on one GPU ran each other out of memory (benchmarks.md, H100 2026-12-07). An eighth of the budget
    keeps a long prompt's chunk buffers for the next chunk (model/keep_buffers.py) and bounds what the process
    holds to about the budget and that share; a lower limit of MLX's own stays. MLX's memory limit is left
    alone: past it MLX's evaluation waits for the work in flight, and on CUDA the host tier's arrays count there.
    """
    if budget <= 0:
        return None
    import mlx.core as mx

    wanted = int(budget * BUFFER_CACHE_SHARE)
    before = int(mx.set_cache_limit(wanted))  # (MLX reads its limit only by setting one)
    if before < wanted:  # never above MLX's own (its CPU build keeps 32 MiB)
        mx.set_cache_limit(before)
    return min(wanted, before), before


def wants_probe(config: RuntimeConfig) -> bool:
    if config.device_probe == "off":
        return False
    return config.device_probe == "on" or config.ssd_cache_dir is not None or bool(config.tune_prefill_step)


def cast_float_weights(model: Any, dtype: Any) -> None:
    """Cast floating weights to `dtype`, leaving quantized integer weights alone."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    cast = [
        (k, v.astype(dtype)) if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype else (k, v)
        for k, v in params
    ]
    model.update(tree_unflatten(cast))
    mx.eval(model.parameters())


def store_identity(model_identity: str, path: Path, kv_scheme: str) -> StoreIdentity:
    """What every SSD file (and every KV-event block hash) must match: model content, tokenizer,
    KV dtype, MLX version and backend. The served name is no part of it: renaming keeps the cache.
    """
    import mlx.core as mx

    from mlxd.kv import file_format
    from mlxd.kv.ssd_store import compute_fingerprint

    tok = path / "tokenizer.json"
    tokenizer_hash = hashlib.sha256(tok.read_bytes()).hexdigest()[:16] if tok.exists() else "none"
    fingerprint = compute_fingerprint(
        {
            "model": model_identity,
            "tokenizer": tokenizer_hash,
            # the native scheme keeps its older name, so existing caches stay valid
            "kv_scheme": ("fp32" if mx.default_device() == mx.cpu else "native") if kv_scheme == "native" else kv_scheme,
            "mlx": getattr(mx, "__version__", "unknown"),
            "backend": str(mx.default_device()),
            "format": str(file_format.FORMAT_VERSION),
        }
    )
    return StoreIdentity(model_id=model_identity, fingerprint=fingerprint, tokenizer_hash=tokenizer_hash)
