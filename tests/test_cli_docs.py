"""docs/cli.md is generated from the argument parser and must not go stale."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gen_cli_docs.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_md_matches_the_parser():
    gen = load_generator()
    assert gen.DOC.read_text() == gen.render(), "docs/cli.md is stale: run python scripts/gen_cli_docs.py"


def test_every_subcommand_and_flag_is_documented():
    gen = load_generator()
    text = gen.render()
    for name, _, parser in gen.subcommands(gen.build_parser()):
        assert f"## mlxd {name}" in text
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in text or f", {flag}" in text, flag


def test_every_preset_is_named_and_a_typo_is_a_usage_error(capsys):
    """`--preset` of serve and build-model accepts each built-in model (test-vlm too) and refuses another
    name as argparse does (exit 2, the names listed), not with a traceback from the model builder."""
    from mlxd.cli import build_parser
    from mlxd.model.presets import PRESETS

    parser = build_parser()
    for command in ("serve", "build-model"):
        for name in PRESETS:
            assert parser.parse_args([command, "--preset", name]).preset == name
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([command, "--preset", "test-vml"])
        assert exited.value.code == 2
        assert "invalid choice: 'test-vml'" in capsys.readouterr().err
    assert "test-vlm" in load_generator().render().split("## mlxd build-model")[1]


def test_python_dash_m_mlxd_is_the_mlxd_command():
    done = subprocess.run([sys.executable, "-m", "mlxd", "build-model", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: mlxd build-model")
