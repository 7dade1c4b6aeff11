"""Tier rules: strictly-longer SSD wins, persist-before-demotion, SSD LRU by mtime."""

import attrs
import pytest

from mlxd.kv.tiering import Demotion, SsdIndex, choose_source, demotion_action, may_demote


@attrs.define
class Entry:
    nbytes: int
    durable: bool = False


def test_choose_source_needs_strictly_longer_ssd():
    assert choose_source(10, 10) == "ram"
    assert choose_source(10, 11) == "ssd"
    assert choose_source(0, 0) == "miss"
    assert choose_source(0, 3) == "ssd"


def test_demotion_action():
    ssd = SsdIndex(max_bytes=100)
    assert demotion_action(Entry(10), None) is Demotion.DROP
    assert demotion_action(Entry(10), ssd) is Demotion.PERSIST
    assert demotion_action(Entry(10, durable=True), ssd) is Demotion.DEMOTE
    assert demotion_action(Entry(1000), ssd) is Demotion.DROP  # can never fit
    assert not may_demote(ssd)(Entry(10))
    assert may_demote(None)(Entry(10))


def test_ssd_index_lru_by_mtime_and_prefix_find():
    ssd = SsdIndex(max_bytes=30)
    assert ssd.add((1, 2, 3), "", nbytes=10, now=1) == []
    ssd.add((5, 6), "", nbytes=10, now=2)
    ssd.touch(ssd.find((1, 2, 3, 4)).record, now=3)  # (1,2,3) is now the newest
    dropped = ssd.add((7, 8), "", nbytes=15, now=4)
    assert [r.tokens for r in dropped] == [(5, 6)]
    assert ssd.bytes == 25 and len(ssd) == 2
    match = ssd.find((1, 2, 3, 4))
    assert match.usable == 3
    assert ssd.find((1, 2, 3)).usable == 2  # capped at len(prompt) - 1, trims
    assert ssd.find((1, 2, 3, 4), "other") is None
    with pytest.raises(ValueError):
        ssd.add((9,), "", nbytes=31, now=5)


def test_ssd_index_replaces_exact_duplicates():
    ssd = SsdIndex()
    ssd.add((1, 2), "", nbytes=10, now=1)
    ssd.add((1, 2), "", nbytes=12, now=2)
    assert len(ssd) == 1 and ssd.bytes == 12
    assert ssd.get((1, 2)).nbytes == 12 and ssd.get((1,)) is None
