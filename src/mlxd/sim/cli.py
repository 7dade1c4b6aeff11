"""`mlxd simulate`: replay a request trace against the serving cache policies.

`run_simulate(args)` runs it (its flags: `sim/flags.py`); `python -m mlxd.sim.cli ...`
runs it standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import attrs

import mlxd  # noqa: F401  (preloads OpenBLAS before anything imports mlx)
from mlxd.kv.cost_model import BLOCK_TOKENS, DEFAULT, CostModel
from mlxd.sim import report
from mlxd.sim.blocks import replay_blocks
from mlxd.sim.flags import DEFAULT_SWEEP, DESCRIPTION, POLICIES, configure_parser
from mlxd.sim.replay import replay_mlxd
from mlxd.sim.results import RunResult
from mlxd.sim.trace import check_block_structure, is_mooncake, load_recording, utf8_tokens

# `mlxd serve`'s SSD layout without --ssd-layout (RuntimeConfig.ssd_layout): a trace without a
# recorded server is replayed as that server would store it.
SERVE_SSD_LAYOUT = "blocks"

GIB = 1024**3


def capacities(args) -> list[int | None]:
    """RAM capacities to run, in blocks (None = unlimited)."""
    if args.ram_blocks is not None:
        return [args.ram_blocks]
    if args.ram_gb is not None:
        return [None]  # bytes are handled in _ram_bytes
    if args.sweep is None:
        return [None]
    if args.sweep == "default":
        return list(DEFAULT_SWEEP)
    return [None if s.strip() in ("inf", "unlimited") else int(s) for s in args.sweep.split(",")]


def _ram_bytes(args, blocks: int | None, cost: CostModel) -> int | None:
    if args.ram_gb is not None:
        return int(args.ram_gb * GIB)
    return None if blocks is None else blocks * cost.kv_bytes(BLOCK_TOKENS)


def _tokenizer(model: Path | None):
    if model is None:
        return utf8_tokens
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def run_all(args, reqs, cost: CostModel, flushes: tuple[float, ...] = ()) -> list[RunResult]:
    policies = [p.strip() for p in args.policy.split(",")]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policy {sorted(unknown)}; choose from {POLICIES}")
    models = ["blocks", "mlxd"] if args.cache_model == "both" else [args.cache_model]
    if "blocks" in models and not is_mooncake(reqs):
        if args.cache_model == "blocks":
            raise SystemExit("the blocks model needs a Mooncake trace (hash_ids)")
        models.remove("blocks")
    ssd_bytes = None if args.ssd_gb is None else round(args.ssd_gb * GIB)
    pages = {"on": (True,), "off": (False,), "both": (False, True)}[getattr(args, "ram_pages", None) or "off"]
    runs = [(m, p, b, paged) for m in models for p in policies for b in capacities(args)
            for paged in (pages if m == "mlxd" else (False,))]
    results = []
    for i, (model, policy, blocks, paged) in enumerate(runs, 1):
        results.append(run_one(_copy_args(args, ram_pages="on" if paged else "off"), reqs, cost, model, policy,
                               blocks, ssd_bytes, flushes))
        _progress(i, len(runs), results[-1])
        if args.format == "json":
            print(report.json_lines(results[-1:]), flush=True)
    return results


def _progress(done: int, total: int, result: RunResult) -> None:
    """One stderr line per finished run, so a long sweep shows where it is."""
    cap = "unlimited" if result.capacity_blocks is None else f"{result.capacity_blocks} blocks"
    print(
        f"mlxd simulate: [{done}/{total}] {result.cache_model} {result.policy} {cap}: "
        f"token hit rate {result.token_hit_rate:.3f} ({result.wall_s:.1f}s)",
        file=sys.stderr,
        flush=True,
    )


def run_one(args, reqs, cost, model, policy, blocks, ssd_bytes, flushes=()) -> RunResult:
    started = time.perf_counter()
    ram_bytes = _ram_bytes(args, blocks, cost)
    if model == "blocks":
        if ram_bytes is not None and blocks is None:
            blocks = ram_bytes // cost.kv_bytes(BLOCK_TOKENS)
        result = replay_blocks(reqs, capacity=blocks, policy=policy, cost=cost, slots=args.slots)
    else:
        if ram_bytes is None and args.recorded_ram_bytes is not None:
            ram_bytes = args.recorded_ram_bytes
        result = replay_mlxd(
            reqs,
            policy=policy,
            cost=cost,
            ram_bytes=ram_bytes,
            ssd_bytes=ssd_bytes,
            ssd=args.ssd_gb is not None or args.recorded_ssd,
            granularity=args.granularity,
            slots=args.slots,
            seed=args.seed,
            snapshot_min_tokens=args.snapshot_min_tokens,
            demote_idle_s=args.demote_idle_s,
            flushes=flushes,
            calibrations=getattr(args, "calibrations", ()),
            sessions=not getattr(args, "no_sessions", False),
            ssd_layout=args.ssd_layout or SERVE_SSD_LAYOUT,
            ssd_block_tokens=args.ssd_block_tokens or 1024,
            advisor_base=getattr(args, "advisor_base", None),
            restore_choice=getattr(args, "restore_choice", "measured"),
            restore_overlap=getattr(args, "restore_overlap", True),
            calibrate_timing=getattr(args, "timing_from_recording", False),
            shared_prefill=_shared_prefill(args),
            ttft_warmup=getattr(args, "ttft_warmup", 0),
            host_bytes=int(args.host_gb * GIB) if getattr(args, "host_gb", None) else None,
            kv_admission_bytes=int(args.kv_admission_gb * GIB) if getattr(args, "kv_admission_gb", None) else 0,
            kv_admission_rule=getattr(args, "kv_admission_rule", None),
            ram_pages=getattr(args, "ram_pages", None) == "on",
            ram_page_tokens=getattr(args, "ram_page_tokens", None) or 1024,
        )
    return attrs.evolve(result, wall_s=time.perf_counter() - started)


def _shared_prefill(args) -> bool:
    """--prefill-sharing: on, off, or auto (on when replaying a recorded server: its one engine)."""
    choice = getattr(args, "prefill_sharing", "auto")
    return choice == "on" or (choice == "auto" and getattr(args, "recorded_server", False))


def _without_sessions(args, reqs, cost, result: RunResult, flushes) -> RunResult:
    """The same mlxd run with the trace's session field ignored (what the index changes)."""
    ssd_bytes = result.ssd_capacity_bytes
    twin = _copy_args(args, no_sessions=True, ram_pages="on" if result.ram_pages else "off")
    return run_one(twin, reqs, cost, "mlxd", result.policy, result.capacity_blocks, ssd_bytes, flushes)


def _copy_args(args: argparse.Namespace, **changes: object) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def apply_recorded_server(args, server: dict | None, cost: CostModel) -> CostModel:
    """Fill every option the user left unset from the recorded server (`--record-trace`).

    Explicit flags win; without a recording the historical defaults apply.
    """
    args.recorded_ram_bytes = None
    args.recorded_ssd = False
    args.demote_idle_s = 0.0
    args.kv_admission_rule = None
    if server is None:
        args.policy = args.policy or ",".join(POLICIES)
        args.cache_model = args.cache_model or "both"
        args.slots = args.slots or 4
        args.snapshot_min_tokens = 256 if args.snapshot_min_tokens is None else args.snapshot_min_tokens
        args.ram_pages = args.ram_pages or "off"
        return cost
    args.recorded_server = True
    args.policy = args.policy or server.get("retention", "lru")
    args.cache_model = args.cache_model or "mlxd"
    args.slots = args.slots or int(server.get("max_batch", 4))
    if args.snapshot_min_tokens is None:
        args.snapshot_min_tokens = int(server.get("snapshot_min_tokens", 256))
    if args.ram_blocks is None and args.ram_gb is None and args.sweep is None:
        args.recorded_ram_bytes = int(server["prompt_cache_bytes"])
    if args.ssd_gb is None and server.get("ssd"):
        args.recorded_ssd = True
        args.ssd_gb = (server.get("ssd_cache_max_bytes") or 0) / GIB or None
    args.demote_idle_s = float(server.get("ssd_demote_idle_s") or 0.0)
    args.restore_choice = server.get("restore_choice", "measured")
    args.restore_overlap = bool(server.get("restore_overlap", False))  # recorded before it was: none weighed
    args.kv_admission_rule = server.get("kv_admission")  # --kv-admission: its rule and room (kv/admission.py)
    if getattr(args, "host_gb", None) is None and server.get("host_cache_bytes"):
        args.host_gb = int(server["host_cache_bytes"]) / GIB
    # A recording from before the layout was recorded served whole files (then the only layout).
    args.ssd_layout = args.ssd_layout or server.get("ssd_layout", "whole")
    args.ssd_block_tokens = args.ssd_block_tokens or server.get("ssd_block_tokens")
    args.ram_pages = args.ram_pages or server.get("ram_pages") or "off"
    args.ram_page_tokens = args.ram_page_tokens or server.get("ram_page_tokens")
    if args.granularity == "auto":
        args.granularity = "token"
    if server.get("kv_bytes_per_token") and not args.cost_model:
        cost = attrs.evolve(cost, kv_bytes_per_token=int(server["kv_bytes_per_token"]))
    base = server.get("restore_advisor_base")  # what the server's startup probe measured
    if base:  # the replay decides restore-or-recompute as the server did: its base, its calibration at each flush
        args.advisor_base = CostModel.from_json(base)
    if base and not args.cost_model:
        # ... is also the best model of this server's timings (TTFT): the served model, this machine
        cost = attrs.evolve(args.advisor_base, kv_bytes_per_token=cost.kv_bytes_per_token)
        args.timing_from_recording = True  # the flushes' calibration scales it (sim/replay.py)
    return cost


def run_fleet(args, reqs, cost: CostModel) -> int:
    """`--replicas N`: every router x policy x capacity, one fleet run each (mlxd model)."""
    from mlxd.sim import fleet
    from mlxd.sim.router import ROUTERS

    routers = [r.strip() for r in args.router.split(",")]
    policies = [p.strip() for p in args.policy.split(",")]
    unknown = (set(routers) - set(ROUTERS)) | (set(policies) - set(POLICIES))
    if unknown:
        raise SystemExit(f"unknown router or policy {sorted(unknown)}; routers {ROUTERS}, policies {POLICIES}")
    if args.cache_model == "blocks":
        raise SystemExit("--replicas simulates the mlxd cache model only")
    ssd_bytes = None if args.ssd_gb is None else int(args.ssd_gb * GIB)
    runs = [(r, p, b) for r in routers for p in policies for b in capacities(args)]
    results = []
    for i, (router, policy, blocks) in enumerate(runs, 1):
        result = fleet.replay_fleet(
            reqs, replicas=args.replicas, router=router, policy=policy, cost=cost,
            ram_bytes=_ram_bytes(args, blocks, cost), ssd_bytes=ssd_bytes, ssd=args.ssd_gb is not None,
            granularity=args.granularity, slots=args.slots, seed=args.seed,
        )
        results.append(result)
        _err(f"mlxd simulate: [{i}/{len(runs)}] {args.replicas} replicas, {router}, {policy}: "
             f"token hit rate {result.token_hit_rate:.3f}, TTFT p50 {result.ttft_s['p50']:.2f} s "
             f"({result.wall_s:.1f}s)")
        if args.format == "json":
            print(report.json_lines(results[-1:]), flush=True)
    if args.format == "table":
        print(fleet.table(results))
    if args.out is not None:
        meta = {
            "trace": Path(args.trace).name, "requests": len(reqs), "cost_model": cost.to_json(),
            "replicas": args.replicas, "slots_per_replica": args.slots, "ssd_gb": args.ssd_gb,
            "seed": args.seed, "command": " ".join(sys.argv),
        }
        for path in fleet.save(args.out, results, meta, name=args.name or f"{Path(args.trace).stem}_fleet"):
            _err(f"wrote {path}")
    return 0


def run_calibrate(args) -> int:
    from mlxd.sim.calibrate import calibrate

    model_dir = args.model
    if model_dir is None:
        from mlxd.model.tiny import ensure_model

        model_dir = ensure_model("default")
    cost = calibrate(Path(model_dir), max_tokens=args.calibrate_tokens, seed=args.seed, log=_err)
    cost.save(args.cost_out)
    print(json.dumps(cost.to_json(), indent=2))
    _err(f"wrote {args.cost_out}")
    return 0


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_simulate(args) -> int:
    if args.calibrate:
        return run_calibrate(args)
    if not args.trace:
        raise SystemExit("mlxd simulate: a TRACE is required (or --calibrate)")
    if args.ttft_warmup < 0:
        raise SystemExit(f"mlxd simulate: --ttft-warmup must be >= 0, not {args.ttft_warmup}")
    cost = CostModel.load(args.cost_model) if args.cost_model else DEFAULT
    try:
        recording = load_recording(args.trace, limit=args.limit, tokenize=_tokenizer(args.model))
    except OSError as exc:  # no such file, a directory, no access
        raise SystemExit(f"mlxd simulate: cannot read {args.trace}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a line that is not JSON, or not a request of a known trace format
        raise SystemExit(f"mlxd simulate: {args.trace}: {exc}") from None
    reqs = recording.reqs
    cost = apply_recorded_server(args, recording.server, cost)
    if args.fit_ttft_out is not None:
        from mlxd.sim.ttft_fit import DEFAULT_WARMUP, OUTLIER_FENCE, OUTLIER_FLOOR, fit_recording

        warmup = DEFAULT_WARMUP if args.fit_warmup is None else args.fit_warmup
        if warmup < 0:
            raise SystemExit(f"mlxd simulate: --fit-warmup must be >= 0, not {warmup}")
        fence = OUTLIER_FENCE if args.fit_outlier_fence is None else args.fit_outlier_fence
        if fence < 0:
            raise SystemExit(f"mlxd simulate: --fit-outlier-fence must be >= 0, not {fence}")
        floor = OUTLIER_FLOOR if args.fit_outlier_floor is None else args.fit_outlier_floor
        if floor < 0:
            raise SystemExit(f"mlxd simulate: --fit-outlier-floor must be >= 0, not {floor}")
        fitted = fit_recording(reqs, cost, warmup=warmup, tier_warmup=args.ttft_warmup, fence=fence, floor=floor)
        fitted.save(args.fit_ttft_out)
        print(json.dumps(fitted.to_json(), indent=2))
        return 0
    if args.host_gbps is not None:
        cost = attrs.evolve(cost, host_bytes_per_s=args.host_gbps * 1e9)
    if is_mooncake(reqs) and args.granularity != "token":
        check_block_structure(reqs)
    args.calibrations = recording.calibrations
    if args.replicas > 1:
        return run_fleet(args, reqs, cost)
    results = run_all(args, reqs, cost, recording.flushes)
    if args.format == "table":
        print(report.table(results))
        if args.ram_pages in ("on", "both"):
            print(report.ram_pages_table(results))
        if any(r.kv_admission for r in results):
            print(report.admission_table(results))
    sessions = len({r.session for r in reqs if r.session is not None})
    if sessions and not args.no_sessions:
        pairs = [(r, _without_sessions(args, reqs, cost, r, recording.flushes)) for r in results
                 if r.cache_model == "mlxd"]
        if args.format == "table":
            print(report.session_table(pairs, sessions))
        else:
            print(json.dumps({"session_index": report.session_json(pairs, sessions)}), flush=True)
    if args.out is not None:
        meta = {
            "trace": Path(args.trace).name,
            "requests": len(reqs),
            "cost_model": cost.to_json(),
            "slots": args.slots,
            "ssd_gb": args.ssd_gb,
            "ssd_layout": args.ssd_layout or SERVE_SSD_LAYOUT,
            "seed": args.seed,
            "command": " ".join(sys.argv),
        }
        name = args.name or Path(args.trace).stem
        for path in report.save(args.out, results, meta, name=name):
            _err(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlxd simulate", description=DESCRIPTION)
    configure_parser(parser)
    return run_simulate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
