"""The environment's arms (MLXD_SUFFIX_ATTENTION, MLXD_SUFFIX_APART, MLXD_BATCH_HANDOVER, MLXD_MASK_*):
a value none of them knows is a clear error when the server starts, never an arm silently off (a typo
such as MLXD_BATCH_HANDOVER=yes measured the default path as the arm)."""

from __future__ import annotations

import pytest
import trio
from tests.serving import config_for

from mlxd.engine import core
from mlxd.model import batch_handover, suffix_attention
from mlxd.runtime.supervisor import open_runtime


@pytest.mark.parametrize(("value", "on"), [("", True), ("unfused", True), ("off", False), ("0", False),
                                           ("fused", False)])
def test_suffix_attention_values(monkeypatch, value, on):
    monkeypatch.setenv("MLXD_SUFFIX_ATTENTION", value)
    assert suffix_attention.wanted() is on  # on by default (a GPU's; the CPU installs nothing)


@pytest.mark.parametrize("value", ["unfuse", "on", "1"])
def test_suffix_attention_unknown_values_are_an_error(monkeypatch, value):
    monkeypatch.setenv("MLXD_SUFFIX_ATTENTION", value)
    with pytest.raises(ValueError, match="MLXD_SUFFIX_ATTENTION"):
        suffix_attention.wanted()


@pytest.mark.parametrize(("value", "on"), [("", True), ("0", False), ("off", False), ("1", True), ("on", True)])
def test_batch_handover_values(monkeypatch, value, on):
    monkeypatch.setenv("MLXD_BATCH_HANDOVER", value)
    assert batch_handover.wanted() is on


@pytest.mark.parametrize("value", ["yes", "2", "enabled"])
def test_batch_handover_unknown_values_are_an_error(monkeypatch, value):
    monkeypatch.setenv("MLXD_BATCH_HANDOVER", value)
    with pytest.raises(ValueError, match="MLXD_BATCH_HANDOVER"):
        batch_handover.wanted()


@pytest.mark.parametrize(("value", "tokens"), [("", 0), ("0", 0), ("256", 256)])
def test_suffix_apart_values(value, tokens):
    assert core.suffix_apart(value) == tokens


@pytest.mark.parametrize("value", ["abc", "-5", "1.5"])
def test_suffix_apart_unknown_values_are_an_error(value):
    with pytest.raises(ValueError, match="MLXD_SUFFIX_APART"):
        core.suffix_apart(value)


@pytest.mark.parametrize(("name", "value"), [("MLXD_MASK_LAUNCH", "Ready"), ("MLXD_MASK_CACHE", "-1"),
                                             ("MLXD_MASK_MODE", "ahaed"), ("MLXD_SUFFIX_ATTENTION", "on")])
def test_a_bad_arm_stops_the_start(tiny_model_dir, monkeypatch, name, value):
    # MLXD_SUFFIX_ATTENTION=on was silently off (only "unfused" counted); the mask arms already failed
    # the start (StepMasks), kept here as the same promise.
    monkeypatch.setenv(name, value)

    async def start() -> None:
        async with open_runtime(config_for(tiny_model_dir)):
            pass

    with pytest.raises(BaseException) as err:  # noqa: PT011 (trio's nurseries wrap it in a group)
        trio.run(start)
    assert any(isinstance(e, ValueError) and name in str(e) for e in _leaves(err.value))


def _leaves(exc: BaseException) -> list[BaseException]:
    inner = getattr(exc, "exceptions", None)
    if inner:
        return [leaf for e in inner for leaf in _leaves(e)]
    return [exc, *([_leaves(exc.__cause__)[0]] if exc.__cause__ is not None else [])]
