"""A recorded request carries the page-cache bytes its restore advisor weighed (`PrefixLookup.resident`), and a
replay weighs the same: the simulator has no page cache, and without them a restore the server made from it
(cheap) is costed as a disk read (dear), so a close call can go the other way in the replay (by all signs the
cause of tests/test_sim_agreement.py's one failure, a replay 736 SSD-hit tokens short on a loaded CI run,
2026-12-06)."""

from __future__ import annotations

import json

import attrs
from tests.test_restore_split import block_record

from mlxd.kv.cost_model import DEFAULT
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.restore_decision import RECOMPUTE, RESTORE, RestoreAdvisor
from mlxd.kv.tiers import CacheTiers
from mlxd.sim.trace import TraceRecorder, load_recording

# a disk slow enough that recomputing 139 tokens beats reading them cold, a page cache fast enough that it does not
SLOW_DISK = attrs.evolve(DEFAULT, restore_bytes_per_s=1e3, page_cache_bytes_per_s=1e12)
PROMPT = tuple(range(1, 140))


def tiers(residency=None) -> CacheTiers:
    t = CacheTiers(PromptCache(max_bytes=10**9), ssd=True, advisor=RestoreAdvisor(base=SLOW_DISK), residency=residency)
    t.load_records([block_record(128, 32)])
    return t


def test_the_lookup_reports_the_resident_bytes_it_weighed_and_a_replay_given_them_decides_alike():
    live = tiers(lambda record: tuple(b.nbytes for b in record.blocks))  # all of it in the page cache
    served = live.lookup(PROMPT)
    assert served.plan.arm == RESTORE and served.resident == (320, 320, 320, 320)
    # the simulator as it was: no page cache, every byte a disk read: it recomputes what the server restored
    assert tiers().lookup(PROMPT).plan.arm == RECOMPUTE and tiers().lookup(PROMPT).resident is None
    # the replay given the recorded bytes (sim/replay.py sets them per request): the server's choice
    replay = tiers()
    replay.residency = lambda record, recorded=served.resident: recorded
    assert replay.lookup(PROMPT).plan == served.plan
    # residency that does not enter the costs (no page-cache rate) is not reported
    flat = tiers(lambda record: (1,))
    flat.advisor.resident_bytes_per_s = 0.0
    assert flat.lookup(PROMPT).resident is None


def test_a_recorded_line_carries_the_resident_bytes_and_the_flush_its_page_cache_rate(tmp_path):
    path = tmp_path / "trace.jsonl"
    recorder = TraceRecorder(path)
    recorder.server(model="m")
    recorder.record(t=0.0, tokens=PROMPT, output_tokens=1, cache_tier="ssd", cached_tokens=128,
                    resident=(320, 320, 0, 0))
    recorder.record(t=0.5, tokens=PROMPT, output_tokens=1)  # no SSD candidate weighed: nothing recorded
    recorder.flush(t=1.0, restore_advisor={"prefill_scale": 1.0, "restore_bytes_per_s": 1e9,
                                           "page_cache_bytes_per_s": 2e9})
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[1]["resident"] == [320, 320, 0, 0] and "resident" not in lines[2]
    recording = load_recording(path)
    assert [r.resident for r in recording.reqs] == [(320, 320, 0, 0), None]
    assert recording.calibrations[-1]["page_cache_bytes_per_s"] == 2e9
