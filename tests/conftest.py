import mlxd  # preloads OpenBLAS before mlx  # noqa: F401, I001

from pathlib import Path

import pytest

from mlxd.model import build_model, load_model


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
