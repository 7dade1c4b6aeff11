"""--adapter NAME=DIR: mlx-lm LoRA adapters served beside the base model, chosen per row.

At load, every linear layer an adapter trains (as mlx-lm's `linear_to_lora_layers`
picks them from its `adapter_config.json`) is wrapped in a `RowLoRA` that holds
the A and B matrices of all adapters stacked (index 0: the base, zeros). Before
each forward the batch's rows are selected (`RowAdapters.rows`), and each row
adds its own adapter's term: `y = base(x) + scale[i] * ((x @ A[i]) @ B[i])`. So
one forward serves base rows and rows of several adapters together, and a
forward with only base rows skips the term altogether.

Each adapter is its own cache namespace, `lora:<hash of its two files>`: the
RAM tier, SSD file paths, sessions and KV events all key on it, so no prefix is
ever shared across adapters or with the base (namespace "").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from mlxd.engine.ops import ModelRefused
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.engine")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
# The batch classes whose methods run the model: each selects its rows' adapters first.
_FORWARD_METHODS = ("prompt", "generate", "_step", "_verify")


@attrs.frozen
class AdapterInfo:
    """One served adapter: what /v1/models lists and requests name."""

    name: str
    path: str
    namespace: str  # its cache namespace: "lora:<content hash>"
    rank: int
    scale: float
    modules: int  # linear layers it changes


def check_names(adapters: Sequence[tuple[str, str]], *, reserved: Sequence[str]) -> None:
    """Names must be unique and differ from the served model's names (ModelRefused)."""
    seen: set[str] = set()
    for name, _ in adapters:
        if not name or any(c.isspace() for c in name) or "/" in name:
            raise ModelRefused(f"--adapter name {name!r} must be non-empty, without spaces or '/'")
        if name in reserved:
            raise ModelRefused(f"--adapter {name}: the name is the served model's own ({', '.join(reserved)}); "
                               "give the adapter another name")
        if name in seen:
            raise ModelRefused(f"--adapter {name} is given twice")
        seen.add(name)


@attrs.define(eq=False)
class _Read:
    """An adapter directory read and checked on its own (not yet against the model)."""

    name: str
    path: Path
    num_layers: int
    keys: list[str] | None
    rank: int
    scale: float
    weights: dict[str, Any]
    namespace: str


def read_adapter(name: str, directory: str) -> _Read:
    """Read `directory` as mlx_lm.lora writes it; refuse what mlx-lm would refuse or mlxd cannot serve."""
    path = Path(directory).expanduser()
    where = f"--adapter {name}={directory}"
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / f).is_file():
            raise ModelRefused(f"{where}: no {f} there (an mlx-lm adapter directory has {CONFIG_FILE} "
                               f"and {WEIGHTS_FILE})")
    raw_config = (path / CONFIG_FILE).read_bytes()
    try:
        cfg = json.loads(raw_config)
    except ValueError as exc:
        raise ModelRefused(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from exc
    kind = cfg.get("fine_tune_type", "lora")
    if kind == "dora":
        raise ModelRefused(f"{where}: DoRA adapters are not supported (only fine_tune_type 'lora')")
    if kind == "full":
        raise ModelRefused(f"{where}: a full fine-tune is a model of its own: serve it with --model")
    if kind != "lora":
        raise ModelRefused(f"{where}: unknown fine_tune_type {kind!r} (only 'lora' is supported)")
    params = cfg.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("rank"), int) or "scale" not in params:
        hint = " ('alpha' is not mlx-lm's name for it: use 'scale')" if isinstance(params, dict) and "alpha" in params else ""
        raise ModelRefused(f"{where}: {CONFIG_FILE} needs lora_parameters with an integer 'rank' and a 'scale'{hint}")
    num_layers = cfg.get("num_layers")
    if not isinstance(num_layers, int):
        raise ModelRefused(f"{where}: {CONFIG_FILE} needs an integer 'num_layers'")
    keys = params.get("keys")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise ModelRefused(f"{where}: lora_parameters.keys must be a list of module names")
    raw_weights = (path / WEIGHTS_FILE).read_bytes()
    try:
        weights = mx.load(str(path / WEIGHTS_FILE))
    except Exception as exc:
        raise ModelRefused(f"{where}: cannot read {WEIGHTS_FILE} ({exc})") from exc
    assert isinstance(weights, dict)
    digest = hashlib.sha256(raw_config + b"\0" + raw_weights).hexdigest()[:16]
    return _Read(name, path, num_layers, keys, int(params["rank"]), float(params["scale"]), weights,
                 f"lora:{digest}")


def lora_targets(model: nn.Module, num_layers: int, keys: Sequence[str] | None) -> dict[str, nn.Module]:
    """The modules mlx-lm's `linear_to_lora_layers` converts, by their path in `model`."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    kinds = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear, nn.Embedding, nn.QuantizedEmbedding)
    layers = model.layers  # type: ignore[attr-defined]
    if keys is None:
        wanted = {p for layer in layers for p, m in layer.named_modules() if hasattr(m, "to_lora") or isinstance(m, kinds)}
    else:
        wanted = set(keys)
    where = {id(m): p for p, m in model.named_modules()}
    out: dict[str, nn.Module] = {}
    for layer in layers[-max(num_layers, 0):]:  # as mlx-lm: 0 (or less) means every layer
        for k, m in layer.named_modules():
            if k in wanted:
                out[f"{where[id(layer)]}.{k}"] = m
    for k, m in model.named_modules():
        if k in wanted:
            out[k] = m
    return out


def _dims(module: nn.Module) -> tuple[int, int]:
    """(input, output) features of a plain or quantized linear layer."""
    out_dims, cols = module.weight.shape
    if isinstance(module, nn.QuantizedLinear):
        return cols * 32 // module.bits, out_dims
    return cols, out_dims


def _terms(read: _Read, model: nn.Module) -> dict[str, tuple[Any, Any]]:
    """The adapter's (A, B) per module path, checked against the model's shapes."""
    targets = lora_targets(model, read.num_layers, read.keys)
    where = f"--adapter {read.name}={read.path}"
    errors, terms = [], {}
    for key in read.weights:
        module_path, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b") or module_path not in targets:
            errors.append(f"{key}: not a LoRA parameter of this model under {CONFIG_FILE}")
    for path, module in targets.items():
        a, b = read.weights.get(f"{path}.lora_a"), read.weights.get(f"{path}.lora_b")
        if a is None and b is None:
            continue
        if type(module) not in (nn.Linear, nn.QuantizedLinear):
            errors.append(f"{path}: a {type(module).__name__} layer (only linear layers are supported)")
            continue
        if a is None:
            errors.append(f"{path}: lora_b without lora_a")
            continue
        if b is None:
            continue  # mlx-lm's lora_b starts at zero: this layer adds nothing
        d_in, d_out = _dims(module)
        if a.shape != (d_in, read.rank) or b.shape != (read.rank, d_out):
            errors.append(f"{path}: shapes {tuple(a.shape)} and {tuple(b.shape)}; this model (rank {read.rank}) "
                          f"needs {(d_in, read.rank)} and {(read.rank, d_out)}")
            continue
        terms[path] = (a, b)
    if errors:
        shown = "; ".join(errors[:5]) + (f"; and {len(errors) - 5} more" if len(errors) > 5 else "")
        raise ModelRefused(f"{where}: the adapter does not fit this model: {shown}")
    return terms


@attrs.define
class _Selection:
    """The adapter index of each row of the forward being built (None: every row is the base)."""

    indices: Any = None  # mx.array (rows,) int32


class RowLoRA(nn.Module):
    """A linear layer plus every adapter's low-rank term, each row taking its own (index 0: none)."""

    def __init__(self, base: nn.Module, a: mx.array, b: mx.array, scales: mx.array, selection: _Selection) -> None:
        super().__init__()
        self.base = base
        self.lora_a = a  # (adapters + 1, in, rank)
        self.lora_b = b  # (adapters + 1, rank, out)
        self.scales = scales  # (adapters + 1,)
        self._selection = selection
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        idx = self._selection.indices
        if idx is None:
            return y
        if idx.shape[0] != x.shape[0]:
            raise RuntimeError(f"adapter rows selected for {idx.shape[0]} rows, the forward has {x.shape[0]}")
        # Each row's own A and B, gathered inside the matmul (no (rows, in, rank) copies).
        z = mx.gather_mm(mx.gather_mm(x, self.lora_a, rhs_indices=idx), self.lora_b, rhs_indices=idx)
        scale = self.scales[idx].astype(z.dtype).reshape(-1, *([1] * (z.ndim - 1)))
        return y + (scale * z).astype(x.dtype)


@attrs.define(eq=False)
class RowAdapters:
    """The served adapters: their wrapped layers' shared row selection, by namespace."""

    infos: tuple[AdapterInfo, ...] = ()
    _index: dict[str, int] = attrs.Factory(dict)  # namespace -> stack index (1..n)
    _selection: _Selection = attrs.Factory(_Selection)

    def index_of(self, namespace: str) -> int:
        """A row's adapter: its namespace's, or 0 (the base) for any other namespace."""
        return self._index.get(namespace, 0)

    @contextlib.contextmanager
    def rows(self, indices: Sequence[int]) -> Iterator[None]:
        """Select each row's adapter for the forwards built inside (restored after: they nest)."""
        before = self._selection.indices
        self._selection.indices = mx.array(list(indices), dtype=mx.int32) if any(indices) else None
        try:
            yield
        finally:
            self._selection.indices = before

    def bind(self, generator: Any, row_index: Callable[[int], int]) -> None:
        """Make the generator's batches select their rows (by uid) before each forward."""
        if not self.infos:
            return
        for attr in ("_prompt_batch", "_generation_batch"):
            batch = getattr(generator, attr)
            batch.__class__ = _selecting(type(batch), self, row_index)


def _selecting(cls: type, adapters: RowAdapters, row_index: Callable[[int], int]) -> type:
    """A subclass of a batch class whose forward-running methods select the batch's rows first."""

    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            with adapters.rows([row_index(uid) for uid in self.uids]):
                return inner(self, *args, **kwargs)

        return method

    methods = {name: wrap(getattr(cls, name)) for name in _FORWARD_METHODS if hasattr(cls, name)}
    return type(f"Adapting{cls.__name__}", (cls,), methods)


def install(model: nn.Module, adapters: Sequence[tuple[str, str]], *, reserved: Sequence[str]) -> RowAdapters:
    """Read, check and apply every `(name, dir)` adapter to `model`; refuse (ModelRefused) what cannot serve."""
    if not adapters:
        return RowAdapters()
    check_names(adapters, reserved=reserved)
    reads = [read_adapter(name, directory) for name, directory in adapters]
    terms = [_terms(r, model) for r in reads]
    for r, t in zip(reads, terms, strict=True):
        if not t:
            raise ModelRefused(f"--adapter {r.name}={r.path}: it changes no layer of this model "
                               f"(no lora_a/lora_b pair in {WEIGHTS_FILE})")
    selection = _Selection()
    on_cpu = mx.default_device() == mx.cpu
    paths = sorted({p for t in terms for p in t})
    modules = dict(model.named_modules())
    wrapped = []
    for path in paths:
        base = modules[path]
        d_in, d_out = _dims(base)
        rank = max(t[path][0].shape[1] for t in terms if path in t)
        dtypes = {x.dtype for t in terms if path in t for x in t[path]}
        dtype = mx.float32 if on_cpu or len(dtypes) > 1 else dtypes.pop()
        a = mx.zeros((len(reads) + 1, d_in, rank), dtype=dtype)
        b = mx.zeros((len(reads) + 1, rank, d_out), dtype=dtype)
        scales = [0.0] * (len(reads) + 1)
        for i, (r, t) in enumerate(zip(reads, terms, strict=True), start=1):
            if path in t:
                ra, rb = t[path]
                a[i, :, : ra.shape[1]] = ra.astype(dtype)
                b[i, : rb.shape[0], :] = rb.astype(dtype)
                scales[i] = r.scale
        wrapped.append((path, RowLoRA(base, a, b, mx.array(scales, dtype=mx.float32), selection)))
    from mlx.utils import tree_unflatten

    model.update_modules(tree_unflatten(wrapped))
    mx.eval(model.parameters())
    infos = tuple(
        AdapterInfo(r.name, str(r.path), r.namespace, r.rank, r.scale, len(t))
        for r, t in zip(reads, terms, strict=True)
    )
    for info in infos:
        log.info("engine.adapter", name=info.name, path=info.path, namespace=info.namespace, rank=info.rank,
                 scale=info.scale, modules=info.modules)
    index = {info.namespace: i for i, info in enumerate(infos, start=1)}
    return RowAdapters(infos, index, selection)
