"""`mlxd serve` refuses what it cannot serve with exit status 2 and one line that says why, as for a
locked SSD directory (test_ssd_lock) or a port in use (test_connections): never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlxd.cli", "serve", "--port", "0", "--device-probe", "off",
                           "--log-format", "json", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("model", "says"), [
    ("/no/such/model/dir", "--model /no/such/model/dir: no such directory"),
    ("~/no-such-model-dir", "--model ~/no-such-model-dir: no such directory"),
    # no network is tried: the hub client refuses the id's form first
    ("not/a/valid//id", "--model not/a/valid//id: not a local directory, and not fetched as a Hugging Face repo id"),
])
def test_a_model_that_is_not_there(model: str, says: str) -> None:
    out = serve("--model", model)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"mlxd serve: {says}" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_an_ssd_cache_path_that_is_a_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    taken = tmp_path / "kv"
    taken.write_text("not a directory")
    out = serve("--model", str(tiny_model_dir), "--ssd-cache", str(taken))
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"mlxd serve: --ssd-cache {taken}: " in out.stderr and "File exists" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert taken.read_text() == "not a directory"


@pytest.mark.parametrize("model", ["/no/such/model/dir", "./no-such-model-dir"])
def test_a_missing_model_directory_is_refused_before_mlx_loads(model: str) -> None:
    """A typo in a path costs no start: refused before MLX, mlx-lm and the tokenizers' libraries load."""
    probe = ("import sys; from mlxd.cli import main; code = main(['serve', '--model', sys.argv[1], '--port', '0']); "
             "print(code, sorted(m for m in ('mlx.core', 'mlx_lm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, model], capture_output=True, text=True, timeout=300)
    assert out.stdout.split("\n")[0] == "2 []", (out.stdout, out.stderr[-3000:])
    assert f"mlxd serve: --model {model}: no such directory" in out.stderr
