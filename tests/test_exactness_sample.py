"""The exactness contract's CI sample (issue 27): no cache path changes an answer.

Every cell of `exactness.CELLS` (each cache kind the presets build, KV8 and KV4
against same-scheme recompute, and a CacheList model) replays random greedy and
seeded requests (plain, tool turns, n = 2, stop strings) cold, from RAM, from
SSD, resumed from a generation checkpoint, after a restart and on a replica
sharing the SSD directory, and compares tokens and logprobs with a cold
recompute. `benchmarks/exactness.py` runs the same harness for 10,000 replays.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import exactness as ex
from mlxd.model import build_model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dirs = {"test": tiny_model_dir, "falcon_h1": ex.falcon_h1_dir(tiny_model_dir, root / "falcon_h1")}
    for preset in {p for p, _ in ex.CELLS} - dirs.keys():
        dirs[preset] = build_model(root / preset, preset, seed=0)
    return dirs


async def test_a_sample_of_replays_matches_cold_recompute(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    replays: list[ex.Replay] = []
    for i, (preset, bits) in enumerate(ex.CELLS):
        replays += await ex.run_cell(model_dirs[preset], preset, bits, tmp_path / str(i), conversations=3,
                                     seed=2027 + i, max_tokens=(6, 9), checkpoint_every=2, concurrency=4,
                                     demote_idle_s=1.0, ssd_layout=("whole", "blocks")[i % 2],
                                     restore_landing=("mlx", "host")[i // 2 % 2])
    summary = ex.summarize(replays)
    # Quantized cells may show "kv-noise" (equal tokens, logprobs within exactness.KV_NOISE): allowed here.
    assert summary["mismatches"] == 0, [r for r in replays if r.verdict == "mismatch"]
    assert summary["replays"] >= 200, summary["replays"]
    # Every path, cell, feature and sampling mode was exercised (the tier each replay's prefix came from).
    assert summary["by_cell"].keys() == {f"{p}/{'kv' + str(b) if b else 'native'}" for p, b in ex.CELLS}
    assert summary["by_feature"].keys() == set(ex.FEATURES)
    assert summary["by_sampling"].keys() == {"greedy", "seeded"}
    for path in ("cold:none", "ram:ram", "ssd:ssd", "resumed:checkpoint", "restart:ssd", "replica:ssd"):
        assert summary["by_tier"].get(path, {}).get("replays", 0) > 0, (path, summary["by_tier"].keys())
