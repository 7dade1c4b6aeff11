"""The cache-tier core over content-addressed blocks: the SSD cap counts each block once."""

from __future__ import annotations

from mlxd.kv import blocks as bk
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.tiers import CacheTiers, SsdRecord, Unlink

FP = "f" * 32
PER_TOKEN = 10
SPAN = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


def make(ssd_max: int = 0) -> CacheTiers:
    return CacheTiers(PromptCache(max_bytes=10**9, clock=Clock()), ssd=True, ssd_max_bytes=ssd_max)


def record(tiers: CacheTiers, tokens, *, trimmable: bool = True) -> SsdRecord:
    """A committed manifest, with the spans the block store would choose given what is indexed."""
    blocks = bk.model_blocks(tokens, namespace="", fingerprint=FP, stored=tiers.ssd_has_block,
                             bytes_per_token=PER_TOKEN, block_tokens=SPAN)
    return SsdRecord("", tuple(tokens), len(tokens) * PER_TOKEN, 0.0, trimmable, None, blocks)


def test_shared_prefix_is_counted_once_and_the_cap_admits_both():
    tiers = make(ssd_max=600)
    system = list(range(32))  # two full blocks, shared
    a = record(tiers, system + [1] * 10)
    assert tiers.durable(a) == []
    b = record(tiers, system + [2] * 10)
    assert tiers.durable(b) == []  # 420 + 420 bytes of checkpoints, 420 + 100 unique
    stats = tiers.stats()
    assert stats.ssd_entries == 2 and stats.ssd_bytes == 520 and stats.ssd_blocks == 4
    assert stats.ssd_checkpoint_bytes == 840


def test_supersession_frees_only_what_the_descendant_does_not_share():
    tiers = make()
    short = record(tiers, range(20))
    tiers.durable(short)
    longer = record(tiers, range(40))  # reuses [0, 16) and the partial block [16, 20)
    assert [b.name for b in longer.blocks[:2]] == [b.name for b in short.blocks]
    (unlink,) = tiers.durable(longer)
    assert isinstance(unlink, Unlink) and unlink.record is short
    assert unlink.garbage == ()  # the manifest goes, every block it named stays
    assert tiers.stats().ssd_bytes == 400


def test_eviction_for_the_cap_lists_the_blocks_it_frees():
    tiers = make(ssd_max=500)
    a = record(tiers, list(range(32)) + [1] * 8)
    tiers.durable(a)
    b = record(tiers, list(range(16)) + [2] * 20)  # shares [0, 16) with a
    (unlink,) = tiers.durable(b)  # a+b unique = 400 + 200 > 500: a (older) goes
    assert unlink.record is a
    assert set(unlink.garbage) == {a.blocks[1].name, a.blocks[2].name}
    assert tiers.stats().ssd_bytes == b.nbytes


def test_a_lost_manifest_releases_its_blocks():
    tiers = make()
    a = record(tiers, range(40))
    tiers.durable(a)
    (unlink,) = tiers.lost(a)
    assert unlink.record is a and set(unlink.garbage) == {x.name for x in a.blocks}
    assert tiers.stats().ssd_bytes == 0 and tiers.stats().ssd_blocks == 0
