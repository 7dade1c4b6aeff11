import mlxd  # preloads OpenBLAS before mlx  # noqa: F401, I001

import os
from pathlib import Path

import httpx._transports.default as httpx_default
import pytest

from mlxd.model import build_model, load_model

# Restore every usable SSD prefix: on the tiny models a restore and a prefill take about the
# same few milliseconds, so the measured choice (the default) tips either way on a loaded
# machine and a test expecting an SSD hit would rest on timing luck. Set in the environment
# so server subprocesses inherit it; tests of the measured choice set restore_choice.
os.environ.setdefault("MLXD_RESTORE_CHOICE", "always")
# The tiny model drafts for itself in the speculation tests: priced at its weights (a draft as
# costly as the target) the gate would never let a step verify (engine/speculative.py's
# draft_ceiling). Priced free here; tests of that ceiling set it themselves.
os.environ.setdefault("MLXD_DRAFT_COST", "0")

# Every httpx client (each `httpx.get`, each `openai.OpenAI()`) builds a default SSL context by
# loading certifi's bundle: ~100 ms of CPU each on these machines, though every test talks plain
# HTTP over loopback. The fuzz alone made ~1,900 of them. Built once per test process instead.
_default_ssl_context = httpx_default.create_ssl_context()


def _shared_ssl_context(verify=True, cert=None, trust_env=True):  # httpx's own signature
    if verify is True and cert is None:
        return _default_ssl_context
    return _create_ssl_context(verify=verify, cert=cert, trust_env=trust_env)


_create_ssl_context, httpx_default.create_ssl_context = httpx_default.create_ssl_context, _shared_ssl_context


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "test" preset, built once per session outside the user cache."""
    return build_model(tmp_path_factory.mktemp("models") / "tiny", "test", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path):
    """(model, tokenizer) of the tiny model: mlx_lm.load plus the exact detokenizer."""
    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def vlm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "test-vlm" preset (a vision tower and its image processor), built once per session."""
    return build_model(tmp_path_factory.mktemp("models") / "vlm", "test-vlm", seed=0)
