"""Build small random-weight Qwen3 models offline, and cache the default ones.

`build_model` writes a directory `mlx_lm.load` opens with no hub access:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json and our manifest (written last; it lists every file
with its size and sha256, so a partial or corrupt directory is detectable).
`ensure_model` builds a preset once into the user's cache and reuses it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten

from mlxd.model import bpe
from mlxd.model.presets import PRESETS, ModelPreset, get_preset

Progress = Callable[[str, float], None]

# Bump when the build recipe changes in a way the preset fields don't capture.
RECIPE_VERSION = 2  # 2: tool-call and reasoning markers, tools in the chat template
MANIFEST = "mlxd-model.json"


def stderr_progress(stage: str, fraction: float) -> None:
    """Default progress reporter: one line per update on stderr."""
    print(f"mlxd: building model: {stage} {fraction * 100:3.0f}%", file=sys.stderr, flush=True)


def build_id(preset: ModelPreset, *, seed: int = 0) -> str:
    """Short hash of everything that defines a build."""
    # fields at their defaults are left out, so adding one keeps older builds' ids
    unset = ("architecture", "extra")
    fields = attrs.asdict(preset, filter=lambda a, v: not (a.name in unset and v == a.default))
    recipe = {
        "preset": fields,
        "seed": seed,
        "recipe": RECIPE_VERSION,
        "corpus": bpe.corpus_sha256(),
    }
    blob = json.dumps(recipe, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def cache_root() -> Path:
    """$MLXD_CACHE_DIR, else $XDG_CACHE_HOME/mlxd, else ~/.cache/mlxd."""
    if env := os.environ.get("MLXD_CACHE_DIR"):
        return Path(env)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "mlxd"
    return Path.home() / ".cache" / "mlxd"


def default_model_dir(preset: str = "default", *, seed: int = 0) -> Path:
    """Where `ensure_model` keeps this preset's build."""
    p = get_preset(preset)
    return cache_root() / "models" / f"{p.name}-{build_id(p, seed=seed)}"


def model_config(preset: ModelPreset) -> dict:
    """config.json for mlx_lm.models.qwen3 (and HF-style readers)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "intermediate_size": preset.intermediate_size,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim,
        "max_position_embeddings": preset.max_position_embeddings,
        "rope_theta": preset.rope_theta,
        "rms_norm_eps": preset.rms_norm_eps,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": bpe.SPECIAL_TOKENS.index(bpe.IM_END),
        "pad_token_id": bpe.SPECIAL_TOKENS.index(bpe.ENDOFTEXT),
    } | _architecture_config(preset)


_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "qwen3_next": "Qwen3NextForCausalLM", "mamba2": "Mamba2ForCausalLM"}


def _architecture_config(preset: ModelPreset) -> dict:
    """config.json fields of a non-Qwen3 preset (its model_type and extra fields)."""
    if preset.architecture == "qwen3":
        return {}  # (test-vlm's "vision" extra is written by model/vlm.py)
    extra = {k: list(v) if isinstance(v, tuple) else v for k, v in preset.extra}
    return {"architectures": [_ARCHITECTURES[preset.architecture]], "model_type": preset.architecture} | extra


def _model_class(preset: ModelPreset) -> Any:
    """The mlx-lm model module of the preset's architecture."""
    return importlib.import_module(f"mlx_lm.models.{preset.architecture}")


def _embedding(model: Any) -> Any:
    inner = getattr(model, "model", None) or model.backbone  # mamba2 names its trunk "backbone"
    return getattr(inner, "embed_tokens", None) or inner.embeddings


def random_weights(preset: ModelPreset, *, seed: int, progress: Progress) -> dict[str, mx.array]:
    """Deterministic random fp32 weights for `preset`, keyed like its mlx-lm model."""
    mx.random.seed(seed)
    arch = _model_class(preset)
    model = arch.Model(arch.ModelArgs.from_dict(model_config(preset)))
    # Linear layers keep mlx's uniform(+-1/sqrt(fan_in)) init. The (tied) embedding
    # is rescaled so logits = norm(h) @ E.T have std ~logit_scale: peaked, not flat.
    embed = _embedding(model)
    scale = preset.logit_scale / preset.hidden_size**0.5
    embed.weight = mx.random.normal(embed.weight.shape, scale=scale)
    mx.eval(embed.parameters())
    for i, layer in enumerate(model.layers):
        mx.eval(layer.parameters())
        progress("weights", (i + 1) / len(model.layers))
    weights = dict(tree_flatten(model.parameters()))
    if preset.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # gemma3_text ties when the file has no lm_head
    mx.eval(weights)
    return weights


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(dest: Path, preset: ModelPreset, *, seed: int) -> None:
    """Fsync every file, then write the manifest that marks the build complete."""
    files = {}
    for path in sorted(dest.iterdir()):
        with path.open("rb") as f:
            os.fsync(f.fileno())
        files[path.name] = {"size": path.stat().st_size, "sha256": file_digest(path)}
    manifest = {"preset": preset.name, "build_id": build_id(preset, seed=seed), "seed": seed}
    write_json(dest / MANIFEST, {**manifest, "files": files})


def is_complete(dest: Path) -> bool:
    """True when `dest` holds every file its manifest lists, byte for byte."""
    try:
        files = json.loads((dest / MANIFEST).read_text())["files"]
        for name, meta in files.items():
            path = dest / name
            if path.stat().st_size != meta["size"] or file_digest(path) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def write_model_files(dest: Path, preset: ModelPreset, *, seed: int, progress: Progress) -> None:
    """Every file of a build, into the existing empty directory `dest`."""
    progress("tokenizer", 0.0)
    tokenizer = bpe.train_tokenizer(preset.vocab_size)
    bpe.write_tokenizer(dest, tokenizer, model_max_length=preset.max_position_embeddings)
    progress("tokenizer", 1.0)
    weights = random_weights(preset, seed=seed, progress=progress)
    progress("save", 0.0)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(dest / "config.json", model_config(preset))
    eos = [bpe.SPECIAL_TOKENS.index(t) for t in (bpe.IM_END, bpe.ENDOFTEXT)]
    write_json(dest / "generation_config.json", {"eos_token_id": eos, "pad_token_id": eos[1]})
    if dict(preset.extra).get("vision"):  # test-vlm: a vision tower, its processor and vision tokens
        from mlxd.model.vlm import write_vision_files

        write_vision_files(dest, hidden_size=preset.hidden_size, vocab_size=preset.vocab_size,
                           model_max_length=preset.max_position_embeddings, seed=seed, extra=dict(preset.extra))
    write_manifest(dest, preset, seed=seed)
    progress("save", 1.0)


def replace_dir(src: Path, dest: Path) -> None:
    """Move the finished build `src` to `dest`, replacing whatever was there."""
    old = None
    if dest.exists() or dest.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.rename(dest, old / dest.name)
    os.rename(src, dest)
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_model(
    dest: Path,
    preset: str = "default",
    *,
    seed: int = 0,
    progress: Progress | None = None,
) -> Path:
    """Build `preset` with random weights from `seed` into `dest`; return `dest`.

    Files are written into a temp dir next to `dest` and renamed into place, so a
    crash never leaves a half-written `dest`. An existing `dest` is replaced.
    """
    p = get_preset(preset)
    dest = Path(dest).absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        write_model_files(tmp, p, seed=seed, progress=progress or (lambda stage, f: None))
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock across processes, held for the `with` body."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def reap_temp_dirs(dest: Path) -> None:
    """Remove temp dirs left next to `dest` by builds that crashed."""
    for pattern in (f".{dest.name}.tmp-*", f".{dest.name}.old-*"):
        for stale in dest.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def ensure_model(
    preset: str = "default",
    *,
    seed: int = 0,
    progress: Progress | None = stderr_progress,
) -> Path:
    """The cached build of `preset`, building it first if absent or incomplete."""
    dest = default_model_dir(preset, seed=seed)
    if is_complete(dest):
        return dest
    with file_lock(dest.parent / f".{dest.name}.lock"):
        # Another process may have finished the build while we waited.
        if is_complete(dest):
            return dest
        reap_temp_dirs(dest)
        return build_model(dest, preset, seed=seed, progress=progress)


def main_build_model(argv: list[str] | None = None) -> int:
    """`mlxd build-model [--preset P] [--out DIR] [--seed N]`: print the model dir."""
    parser = argparse.ArgumentParser(prog="mlxd build-model", description=__doc__)
    parser.add_argument("--preset", default="default", help="one of: " + ", ".join(sorted(PRESETS)))
    parser.add_argument("--out", type=Path, help="build here (default: the user cache)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.out is None:
        path = ensure_model(args.preset, seed=args.seed)
    else:
        path = build_model(args.out, args.preset, seed=args.seed, progress=stderr_progress)
    print(f"mlxd: model ready in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(path)
    return 0
