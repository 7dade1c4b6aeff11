"""Restore, recompute or split a cold prefix: measured TTFT of each arm beside the advisor's prediction.

    python benchmarks/bench_restore_split.py [--preset default] [--prefix 2048] [--new 64] [--rounds 3]
    # the disk slower than recomputing (a GPU's regime), reads cold: the overlapped split's case
    bash benchmarks/slow_disk.sh 2000000 /tmp python benchmarks/bench_restore_split.py --cold-reads

A `--prefix`-token conversation is written to an SSD tier in the block layout
(`--block-tokens`), then each round starts fresh runtimes on copies of that
directory (RAM empty: the prefix is cold) and times the next turn (`--new`
tokens more) three ways: `--restore-choice always` (restore it all),
`--restore-choice split` (restore the leading blocks up to the middle, prefill
the rest), `--restore-choice overlap` (recompute the blocks before a cut while
those after it are read, at the cut the probe's costs put first) and no cache
(recompute it all). Beside each arm's median TTFT it prints what
`RestoreAdvisor.plan` predicts for it from the startup probe's cost model, and
which arm the advisor would choose; the `advisor` arm is a server choosing so
itself (`--restore-choice measured`). `--cold-reads`: each arm's copy of the
files leaves the page cache before its turn (written back, then dropped once
the server's startup readahead of its newest files has stopped), so its reads
come from the disk (under `slow_disk.sh`, at its cap). Results go to
benchmarks/results/restore_split-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


async def _turn(rt: Any, prompt: list[int]) -> dict[str, Any]:
    from mlxd import SamplingParams
    from mlxd.runtime.kernel.messages import TokenGenerated

    t0 = time.perf_counter()
    first = None
    tokens = []
    async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=4))) as stream:
        async for event in stream:
            if isinstance(event, TokenGenerated):
                first = first if first is not None else time.perf_counter() - t0
                tokens.append(event.token)
    assert stream.accepted is not None
    return {"ttft_s": first, "cached": stream.accepted.cached_tokens, "tier": stream.accepted.cache_tier,
            "tokens": tokens}


def _config(args: argparse.Namespace, ssd: Path | None, choice: str, probe: str) -> Any:
    from mlxd import RuntimeConfig

    extra: dict[str, Any] = {}
    if ssd is not None:
        extra = {"ssd_cache_dir": ssd, "ssd_layout": "blocks", "ssd_block_tokens": args.block_tokens,
                 "ssd_demote_idle_s": 0, "restore_choice": choice}
    if args.prefill_slice_s is not None:
        extra["prefill_slice_s"] = args.prefill_slice_s
    return RuntimeConfig(model_preset=args.preset, snapshot_min_tokens=64, device_probe=probe,
                         max_context=args.prefix + args.new + 64, **extra)


def drop_page_cache(root: Path) -> None:
    """Write back and forget the pages of every file under `root` (its next reads come from the disk)."""
    os.sync()
    for d, _, names in os.walk(root):
        for n in names:
            fd = os.open(Path(d) / n, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def resident_bytes(root: Path) -> int:
    from mlxd.kv.ssd_store import resident_pages

    page = os.sysconf("SC_PAGE_SIZE")
    return sum(resident_pages(Path(d) / n)[0] * page for d, _, names in os.walk(root) for n in names)


async def settle_and_drop(root: Path, limit_s: float = 60.0) -> int:
    """A started server reads its newest files into the page cache (`SsdStore.warm_page_cache`): wait
    until that warm-up has stopped (the resident bytes unchanged over three looks), then drop them.
    Returns the bytes still resident after the drop."""
    import trio

    seen: list[int] = []
    with trio.move_on_after(limit_s):
        while len(seen) < 3 or len(set(seen[-3:])) > 1:
            seen.append(resident_bytes(root))
            await trio.sleep(0.25)
    drop_page_cache(root)
    return resident_bytes(root)


CHOICES = {"restore": "always", "split": "split", "overlap": "overlap", "advisor": "measured"}


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from mlxd import open_runtime
    from mlxd.kv.restore_decision import RestoreAdvisor
    from mlxd.kv.tiers import SsdMatch, restore_cuts, restore_tails

    rng = np.random.default_rng(args.seed)
    prefix = rng.integers(10, 1000, args.prefix).tolist()
    prompt = prefix + rng.integers(10, 1000, args.new).tolist()
    seeded = root / "seeded"
    async with open_runtime(_config(args, seeded, "always", "on")) as rt:  # writes the prefix; probes once
        await _turn(rt, prefix)
        await rt.flush()
        probe = rt.info.probe
        (record,) = [r for r in rt.cache_owner.tiers.ssd_records() if len(r.tokens) >= args.prefix - 1][:1]
    assert probe is not None
    model = probe.cost_model()
    arms: dict[str, list[dict[str, Any]]] = {"restore": [], "split": [], "overlap": [], "advisor": [],
                                             "recompute": []}
    engine: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for i in range(args.rounds):
        for arm in arms:
            ssd = None
            if arm != "recompute":
                ssd = root / f"{arm}-{i}"
                shutil.copytree(seeded, ssd)
                if args.cold_reads:
                    drop_page_cache(ssd)
            # the probe's costs (saved beside the seeded files) for the overlap's cut; none measured afresh
            async with open_runtime(_config(args, ssd, CHOICES.get(arm, "never"), "auto")) as rt:
                left = await settle_and_drop(ssd) if args.cold_reads and ssd is not None else None
                arms[arm].append({**await _turn(rt, prompt), "resident_bytes_at_turn": left})
                s = (await rt.stats()).engine
                engine[arm].append({k: getattr(s, k) for k in ("overlap_tails", "overlap_tail_tokens",
                                                                "overlap_tails_recomputed", "overlaps_declined")})
    # What the advisor predicts for each arm from the probe's model (no online calibration here).
    common = next((i for i, (a, b) in enumerate(zip(record.tokens, prompt, strict=False)) if a != b),
                  min(len(record.tokens), len(prompt)))
    usable = min(common, len(prompt) - 1)
    cuts = restore_cuts(SsdMatch(record, usable), 0, lambda n: n)
    measured_k = {arm: statistics.median(r["cached"] for r in runs) for arm, runs in arms.items()}
    split_cut = next(c for c, _ in cuts if c.tokens == measured_k["split"])
    tails = [c for c, _ in restore_tails(SsdMatch(record, usable), 0, lambda n: n)]
    advisor = RestoreAdvisor(base=model, weigh_overlap=True)
    plan = advisor.plan(cuts=[c for c, _ in cuts], tails=tails, warm_tokens=0, prompt_tokens=len(prompt))
    overlap_cut = next((c for c in tails if c.tokens - c.start == measured_k["overlap"]), None)
    predicted = {
        "restore": plan.restore_seconds,
        "split": advisor._cut_seconds(split_cut, len(prompt)),
        "overlap": advisor.overlap_seconds(overlap_cut, 0, len(prompt)) if overlap_cut is not None else float("nan"),
        "advisor": plan.seconds,  # a fresh server's own choice (--restore-choice measured) from the same costs
        "recompute": plan.recompute_seconds,
    }
    same = all(r["tokens"] == arms["recompute"][0]["tokens"] for runs in arms.values() for r in runs)
    return {
        "probe_cost_model": model.to_json(), "record_tokens": len(record.tokens), "record_bytes": record.nbytes,
        "blocks": len(record.blocks), "advisor_choice": plan.arm,
        "advisor_cut_tokens": plan.cut.tokens if plan.cut is not None else 0,
        "advisor_cut_start": plan.cut.start if plan.cut is not None else 0,
        "arms": {arm: {"ttft_s": [r["ttft_s"] for r in runs], "median_ttft_s": statistics.median(
            r["ttft_s"] for r in runs), "cached_tokens": measured_k[arm], "tier": runs[0]["tier"],
            "predicted_s": predicted[arm], "engine": engine[arm]} for arm, runs in arms.items()},
        **{f"{arm}_vs_min_restore_recompute": statistics.median(r["ttft_s"] for r in arms[arm]) / min(
            statistics.median(r["ttft_s"] for r in arms[a]) for a in ("restore", "recompute"))
           for arm in ("overlap", "advisor")},
        "same_tokens_every_arm": same,
    }


def main() -> None:
    import trio

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cold-reads", action="store_true", help="drop each arm's files from the page cache first")
    p.add_argument("--prefill-slice-s", type=float, default=None,
                   help="every arm's prefill_slice_s (0: whole steps, as an overlapped split's head is prefilled "
                        "apart; default: the runtime's, which slices a batch prefill into ~50 ms chunks)")
    args = p.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-restore-split-") as tmp:
        out = trio.run(run, args, Path(tmp))
    out.update(args=vars(args), loadavg_before=load_before, loadavg_after=os.getloadavg())
    print(f"prefix {out['record_tokens']} tokens in {out['blocks']} blocks ({out['record_bytes']} bytes); "
          f"the advisor (probe model) would choose: {out['advisor_choice']} ({out['advisor_cut_tokens']} tokens, "
          f"from {out['advisor_cut_start']})")
    print("arm         cached   median TTFT   predicted   measured / predicted")
    for arm, r in out["arms"].items():
        print(f"{arm:<10} {r['cached_tokens']:>7}   {r['median_ttft_s']:9.3f} s  {r['predicted_s']:8.3f} s   "
              f"{r['median_ttft_s'] / r['predicted_s']:6.2f}")
    print(f"overlap / min(restore, recompute): {out['overlap_vs_min_restore_recompute']:.3f}; "
          f"the advisor's (measured) {out['advisor_vs_min_restore_recompute']:.3f}")
    print(f"same greedy tokens in every arm and round: {out['same_tokens_every_arm']}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"restore_split-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
