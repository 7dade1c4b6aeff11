"""The embedding guide's examples run as written, against the tiny test model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
EXAMPLES = sorted((DOCS / "examples").glob("*.py"))
EXPECTED = {
    "embed_nursery.py": ["model: tiny", "finished: length 12 tokens", "channel submit: 0 queued of 32",
                         "flush: {'durable': True", "stopped"],
    "embed_http.py": ["listening on http://127.0.0.1:", "'completion_tokens': 8", "mlxd_requests_submitted_total 1.0",
                      "stopped"],
}


def python_blocks(markdown: str) -> list[str]:
    return [m.strip() for m in re.findall(r"```python\n(.*?)```", markdown, flags=re.S)]


def test_guide_shows_every_example_verbatim():
    blocks = python_blocks((DOCS / "embedding.md").read_text())
    assert {p.name for p in EXAMPLES} == set(EXPECTED)
    for path in EXAMPLES:
        assert path.read_text().strip() in blocks, f"docs/embedding.md must include {path.name} verbatim"


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    """Run every example at once (two cores: they overlap their start-up)."""
    env = {**os.environ, "MLXD_MODEL": str(tiny_model_dir)}  # served under its directory name, "tiny"
    procs = {
        p.name: subprocess.Popen([sys.executable, str(p)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        for p in EXAMPLES
    }
    return {name: (proc, *proc.communicate(timeout=180)) for name, proc in procs.items()}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(runs, name):
    proc, out, err = runs[name]
    assert proc.returncode == 0, err[-3000:]
    for line in EXPECTED[name]:
        assert line in out, f"{line!r} not in the output of {name}:\n{out}"
