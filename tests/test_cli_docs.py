"""docs/cli.md is generated from the argument parser and must not go stale."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
