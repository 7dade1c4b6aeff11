# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What does prompt-lookup speculation (--speculative ngram) buy decode, and what does it cost when it misses?

Engine cores over the same model, one with speculation off, one with
`--speculative ngram` and one per `--draft DIR` (`--speculative draft`; the
model itself as its own draft is the upper bound), decode the same rows in
rotating order, round after round, in one process. Decode tok/s counts the tokens after every row's first one, over the
time from that step to the last (prefill excluded). Two workloads:

- repetitive (edit-style): greedy, the prompt quotes a long span twice and
  starts it a third time; a random-weight model does not copy it the way a
  trained one would, so the acceptance is whatever its own (looping) output
  gives, and it is reported next to the speed;
- non-repetitive: sampled (seeded, at each `--temperature`, default 2 and 4: a
  random-weight model at temperature 1 still collapses into a loop) from a
  prompt of random tokens; at 4 n-grams rarely match (the cost of trying and of
  the back-off), at 2 drafts are partly accepted.

Outputs are checked token for token between the arms. Reported per workload
and batch size: median tok/s per arm, the ratio arm ÷ off per pair of runs
(`--schedule rounds`: an arm's run and the same round's off run; `pairs`: an
arm's run and an off run right beside it, off first every other pair; `bracket`:
the mean of the off runs just before and just after it) as median and
interquartile range, process CPU ms per token beside it (per pair too), and with
`--control` each arm's ratio ÷ off2's of the same round,
acceptance rate and tokens per target forward, and whether each arm's tokens
equalled off's (and off's its own, run twice), and how many of an arm's engine
steps verified drafts (the gate's decisions). Cases run batch by batch (batch 1
first), and the results file is written after each case (to $OUT too when set).

    python benchmarks/bench_speculative.py [--preset default] [--rounds 5] [--tokens 128] [--batch 1 8] [--k 4]
        [--temperature 2 4] [--draft-self] [--draft DIR ...] [--draft-preset bench ...] [--stop-after S]
        [--control] [--schedule rounds|pairs|bracket] [--case-seconds S] [--ngram-k K ...] [--fixed-lengths]

`--control` adds `off2` (speculation off again): its ratios are what two equal
arms differ by on this host, the band an arm's ratio must be read against.

Results go to benchmarks/results/speculative-*.json.
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import gc
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import attrs

from mlxd import RuntimeConfig, SamplingParams
from mlxd.engine.core import EngineCore
from mlxd.engine.drive import run_rows
from mlxd.model import ensure_model
from mlxd.runtime.kernel.messages import GenerationRequest

RESULTS = Path(__file__).resolve().parent / "results"


def workload(
    name: str, batch: int, tokens: int, vocab: int, span: int, temperature: float
) -> list[GenerationRequest]:
    rnd = random.Random(f"{name}-{batch}")
    requests = []
    for i in range(batch):
        if name == "repetitive":
            quoted = [rnd.randrange(3, vocab) for _ in range(span)]
            prompt = quoted + [rnd.randrange(3, vocab) for _ in range(8)] + quoted + quoted[: span // 8]
            sampling = SamplingParams(max_tokens=tokens)
        else:
            prompt = [rnd.randrange(3, vocab) for _ in range(2 * span)]
            sampling = SamplingParams(max_tokens=tokens, temperature=temperature, seed=1000 + i)
        requests.append(GenerationRequest(request_id=f"{name}-{i}", prompt=tuple(prompt), sampling=sampling))
    return requests


@attrs.frozen
class Measured:
    """One arm's run of a case's rows."""

    tok_s: float  # decode tok/s of the rows together (prefill excluded)
    cpu_ms: float  # process CPU ms per decoded token over the same span (every thread of the process)
    tokens: dict[str, list[int]]


def decode(core: EngineCore, requests: list[GenerationRequest]) -> Measured:
    """Decode tok/s and CPU ms per token of the rows together, from the step where each has a token to the last."""
    gc.collect()  # the garbage of the runs before is collected here, untimed, not inside whichever run comes next
    run = run_rows(core, requests)
    return Measured(run.decode_tok_s(), run.decode_cpu_ms_per_token(), run.tokens)


def schedule(arms: list[str], r: int, mode: str) -> list[str]:
    """Round `r`'s runs, in order (every arm once a round; `off` once, or beside each arm).

    rounds: every arm once, the order rotated by one each round (who goes first). pairs: each other
    arm (rotated likewise) right beside an `off` run of its own, off first in every other pair.
    bracket: off, A, off, B, ... (the next round, or one closing off run, ends the last bracket): each
    arm between two off runs (a linear drift cancels), no engine core twice in a row. Every schedule
    but rounds runs the off core more often than each arm: `--control`'s ÷ off2 takes that out."""
    others = arms[1:]
    rotated = others[r % len(others):] + others[: r % len(others)]
    if mode == "rounds":
        return arms[r % len(arms):] + arms[: r % len(arms)]
    if mode == "pairs":
        return [x for i, arm in enumerate(rotated) for x in (["off", arm] if (r + i) % 2 == 0 else [arm, "off"])]
    return [x for arm in rotated for x in ("off", arm)]


@attrs.frozen
class Run:
    round: int
    at: int  # position in its round
    arm: str
    m: Measured


def references(runs: list[Run], mode: str) -> list[tuple[Run, list[Measured]]]:
    """Each arm's run (not off's) with the off runs it is compared with: the round's (rounds), the
    pair's (pairs), the one before and the one after (bracket)."""
    out = []
    for j, run in enumerate(runs):
        if run.arm == "off":
            continue
        if mode == "rounds":
            offs = [x.m for x in runs if x.round == run.round and x.arm == "off"]
        elif mode == "pairs":
            offs = [x.m for x in runs if x.round == run.round and x.at == run.at ^ 1]
        else:
            offs = [runs[j - 1].m, runs[j + 1].m]
        out.append((run, offs))
    return out


def spread(values: list[float]) -> dict[str, Any]:
    """Median and interquartile range of per-pair ratios (and the values, rounded)."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": round(statistics.median(values), 4), "iqr": [round(q[0], 4), round(q[2], 4)],
            "values": [round(x, 3) for x in values]}


def main(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    model = Path(args.model) if args.model else ensure_model(args.preset)
    base = RuntimeConfig(model=str(model), max_batch=max(args.batch), prompt_cache_bytes=0, device_probe="off",
                         default_max_tokens=args.tokens, max_context=8192)
    cores = {"off": EngineCore(base)}
    for k in dict.fromkeys([args.k, *args.ngram_k]):  # n-gram arms: "ngram" at --k, "ngram k=K" at --ngram-k
        config = RuntimeConfig(**{**_fields(base), "speculative": "ngram", "num_draft_tokens": k})
        name = "ngram" if k == args.k else f"ngram k={k}"
        cores[name] = EngineCore(config)
        if args.fixed_lengths:  # every row drafts K at every try (issue 23's adaptive lengths off)
            os.environ["MLXD_DRAFT_LENGTH"] = "fixed"  # read when the core is built
            cores[f"{name} fixed"] = EngineCore(config)
            del os.environ["MLXD_DRAFT_LENGTH"]
        if args.unbounded:  # a step whose drafts cannot pay verifies anyway (before SpeculationGate.can_pay)
            cores[f"{name} unbounded"] = EngineCore(config)
    if args.control:  # speculation off again, with weights of its own: what two equal arms differ by here
        cores["off2"] = EngineCore(base)
    for draft in args.draft:  # --speculative draft arms, named by the draft's directory
        name = "draft=self" if Path(draft).resolve() == model.resolve() else f"draft={Path(draft).name}"
        config = RuntimeConfig(**{**_fields(base), "speculative": "draft", "draft_model": draft,
                                  "num_draft_tokens": args.k})
        cores[name] = EngineCore(config)
        if args.probe_all and name != "draft=self":  # the gate's probes verifying every row, as before d3c0904
            os.environ["MLXD_DRAFT_PROBE_ROWS"] = "0"  # read when the core is built
            cores[f"{name} probe-all"] = EngineCore(config)
            del os.environ["MLXD_DRAFT_PROBE_ROWS"]
    began = time.perf_counter()
    infos = {arm: core.load() for arm, core in cores.items()}
    for arm, core in cores.items():
        if arm.endswith(" unbounded"):
            core._drafts.gate.explore_every = 1  # every refusal lets its step through: can_pay never refuses
    print(f"[{time.perf_counter() - began:.0f} s] loaded {', '.join(cores)}", flush=True)
    vocab = infos["off"].vocab_size
    out: dict[str, Any] = {
        "model": args.model or args.preset, "device": str(mx.default_device()), "tokens": args.tokens,
        "rounds": args.rounds, "k": args.k, "temperatures": args.temperature, "host": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cases": {},
    }
    workloads = [("repetitive", 0.0)] * ("repetitive" in args.workloads) + [
        ("non-repetitive", t) for t in args.temperature if "non-repetitive" in args.workloads]
    cases = [(name, temperature, batch) for batch in args.batch for name, temperature in workloads]
    cases = cases if args.cases == "all" else []
    for i, (name, temperature, batch) in enumerate(cases):  # batch 1 first: a run cut short keeps it
        case_start = time.perf_counter()
        # --budget: this case (its warm-up included) ends by its share of the seconds left
        deadline = (case_start + (args.budget - (case_start - began)) / (len(cases) - i) - 2.0
                    if args.budget else float("inf"))
        if args.stop_after and time.perf_counter() - began > args.stop_after:
            print(f"[{time.perf_counter() - began:.0f} s] --stop-after {args.stop_after:g}: {name} batch {batch} "
                  "and what follows not run", flush=True)
            out["skipped"] = [*out.get("skipped", []), f"{name} t={temperature:g}/batch{batch}"]
            continue
        requests = workload(name, batch, args.tokens, vocab, args.span, temperature)
        warm = [attrs.evolve(r, sampling=attrs.evolve(r.sampling, max_tokens=min(args.tokens, 24))) for r in requests]
        for core in cores.values():
            decode(core, warm)  # warm every arm's kernels for this batch's shapes
        # The same arm twice: is the platform itself deterministic for this workload?
        repeatable = (decode(cores["off"], requests).tokens == decode(cores["off"], requests).tokens
                      if args.repeat_check else None)
        arms = list(cores)
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        cpu: dict[str, list[float]] = {arm: [] for arm in arms}
        ratios: dict[str, list[float]] = {arm: [] for arm in arms[1:]}
        cpu_ratios: dict[str, list[float]] = {arm: [] for arm in arms[1:]}
        same = dict.fromkeys(arms[1:], True)
        before = {arm: cores[arm].stats().speculation for arm in arms[1:]}
        case_began, rounds, runs, last = time.perf_counter(), 0, [], 0.0
        for r in range(args.rounds):
            now = time.perf_counter()
            if r >= 3 and ((args.case_seconds and now - case_began > args.case_seconds) or now + last > deadline):
                break  # --case-seconds, --budget: no new round past them, or that would end past --budget's share
            runs += [Run(r, at, arm, decode(cores[arm], requests)) for at, arm in enumerate(schedule(arms, r, args.schedule))]
            rounds, last = rounds + 1, time.perf_counter() - now
        if args.schedule == "bracket":  # the last arm's closing off run
            runs.append(Run(rounds, 0, "off", decode(cores["off"], requests)))
        for run in runs:
            rates[run.arm].append(run.m.tok_s)
            cpu[run.arm].append(run.m.cpu_ms)
        for run, offs in references(runs, args.schedule):  # in round order: each arm once a round
            off_tok_s, off_cpu = statistics.fmean(o.tok_s for o in offs), statistics.fmean(o.cpu_ms for o in offs)
            same[run.arm] = same[run.arm] and all(run.m.tokens == o.tokens for o in offs)
            ratios[run.arm].append(run.m.tok_s / off_tok_s)
            cpu_ratios[run.arm].append(run.m.cpu_ms / off_cpu if off_cpu else 0.0)
        label = name if name == "repetitive" else f"{name} t={temperature:g}"
        case: dict[str, Any] = {
            "batch": batch, "schedule": args.schedule, "rounds": rounds,
            "seconds": round(time.perf_counter() - case_began, 1), "off_tok_s": statistics.median(rates["off"]),
            "off_cpu_ms_per_token": statistics.median(cpu["off"]), "off_repeatable": repeatable, "arms": {}}
        for arm in arms[1:]:
            b, a = before[arm], cores[arm].stats().speculation
            ratio, cpu_ratio = spread(ratios[arm]), spread(cpu_ratios[arm])
            c = case["arms"][arm] = {
                "tok_s": statistics.median(rates[arm]), "ratio_median": ratio["median"], "ratio_iqr": ratio["iqr"],
                "ratios": ratio["values"], "cpu_ms_per_token": statistics.median(cpu[arm]),
                "cpu_ratio_median": cpu_ratio["median"], "cpu_ratio_iqr": cpu_ratio["iqr"],
                "identical": same[arm]}
            line = (f"{label:>20} batch {batch} {arm:>14}: off {case['off_tok_s']:.1f} tok/s, {c['tok_s']:.1f} tok/s, "
                    f"ratio {ratio['median']:.3f} IQR {ratio['iqr']}, CPU/token {c['cpu_ms_per_token']:.2f} ms "
                    f"(off {case['off_cpu_ms_per_token']:.2f}) ratio {cpu_ratio['median']:.3f} IQR {cpu_ratio['iqr']}")
            if "off2" in ratios and arm != "off2":  # ÷ the control's ratio of the same round: its schedule's bias out
                control = spread([x / y for x, y in zip(ratios[arm], ratios["off2"], strict=True)])
                c["vs_control_median"], c["vs_control_iqr"] = control["median"], control["iqr"]
                line += f", ÷ off2 {control['median']:.3f} IQR {control['iqr']}"
            if b is None or a is None:  # off2: speculation off
                print(f"{line}, identical {c['identical']}, {len(ratios[arm])} pairs {ratio['values']}", flush=True)
                continue
            proposed, accepted = a.proposed - b.proposed, a.accepted - b.accepted
            rows = a.verified_rows - b.verified_rows
            c.update({
                "acceptance": accepted / proposed if proposed else 0.0,
                "tokens_per_forward": (rows + accepted) / rows if rows else 0.0,
                "drafts_per_try": proposed / rows if rows else 0.0,  # the rows' draft lengths, on average
                "proposed": proposed, "accepted": accepted,
                "verify_steps": a.verify_steps - b.verify_steps, "gate_pauses": a.gate_pauses,
                # The gate's decisions in the timed rounds: decode steps, those it kept from verifying
                # (paused, or measuring the plain rate); the rest verified drafts or had none to verify.
                "steps": a.decode_steps - b.decode_steps, "withheld": a.gate_withheld_steps - b.gate_withheld_steps,
                "draft_rows_per_step": ((a.draft_rows - b.draft_rows) / (a.draft_steps - b.draft_steps)
                                        if a.draft_steps > b.draft_steps else 0.0),
                # The gate's probes that verify nothing (a draft model at batch > 1): rows' drafts made
                # for them, and of those, the ones the rows then emitted.
                "gate_probes": a.gate_probes - b.gate_probes,
                "gate_probe_accepted": a.gate_probe_accepted - b.gate_probe_accepted,
                # Steps whose drafts could not pay even if all accepted (no read, no verify), and steps that read
                # the rows' pending tokens back (each waits for the forward in flight).
                "cannot_pay": a.gate_cannot_pay_steps - b.gate_cannot_pay_steps,
                "pending_reads": a.pending_reads - b.pending_reads,
            })
            print(f"{line}, acceptance {c['acceptance']:.2f}, tokens/forward {c['tokens_per_forward']:.2f}, drafts/try "
                  f"{c['drafts_per_try']:.2f}, verify "
                  f"steps {c['verify_steps']} of {c['steps']} (gate withheld {c['withheld']}, pauses "
                  f"{c['gate_pauses']}, probes {c['gate_probes']}, cannot pay {c['cannot_pay']}, reads {c['pending_reads']}), draft rows/step {c['draft_rows_per_step']:.1f}, "
                  f"identical {c['identical']} (off vs off: {repeatable}), {len(ratios[arm])} pairs "
                  f"{ratio['values']}", flush=True)
        out["cases"][f"{label}/batch{batch}"] = case
        save(out, args.result)  # after every case: a run cut short keeps what it measured
        print(f"[{time.perf_counter() - began:.0f} s] {label} batch {batch} done", flush=True)
    for draft in args.draft if args.prefix_lengths else []:
        out.setdefault("draft_prefix", {})[draft] = draft_prefix(draft, cores["off"], args.prefix_lengths, args.k)
    return out


def save(out: dict[str, Any], path: Path) -> None:
    """The results so far, to `path` (and to $OUT when set: a device run's files come back from there)."""
    path.parent.mkdir(exist_ok=True)
    text = json.dumps(out, indent=2)
    path.write_text(text)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / path.name).write_text(text)


def draft_prefix(draft_dir: str, target: EngineCore, lengths: list[int], k: int) -> dict[str, Any]:
    """What a draft model's prefix recompute costs at a row's first step, next to a step that follows."""
    from mlxd.engine.draft import ModelDrafts, load_draft

    draft = load_draft(draft_dir, target.tokenizer, prefill_step=target.prefill_step_size)
    rnd = random.Random(7)
    out: dict[str, Any] = {}
    for n in lengths:
        tokens = [rnd.randrange(3, 8000) for _ in range(n)]
        row = ModelDrafts(draft)
        t0 = time.perf_counter()
        drafts = row.propose(tokens, 5, k)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        row.propose([*tokens, 5, *drafts[:2]], drafts[2], k)  # two drafts accepted, the rest rolled back
        then = time.perf_counter() - t0
        target_s = _prefill_seconds(target, tokens)
        out[str(n)] = {"first_step_s": first, "next_step_s": then, "target_prefill_s": target_s}
        print(f"draft {Path(draft_dir).name}: prefix {n} tokens recomputed in {first * 1000:.1f} ms "
              f"(the target prefills them in {target_s * 1000:.1f} ms); a following step {then * 1000:.1f} ms",
              flush=True)
    return out


def _prefill_seconds(core: EngineCore, tokens: list[int]) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(core.model)
    t0 = time.perf_counter()
    for at in range(0, len(tokens), core.prefill_step_size):
        core.model(mx.array([tokens[at:at + core.prefill_step_size]]), cache=caches)
        mx.eval([c.state for c in caches])
    return time.perf_counter() - t0


def _fields(config: RuntimeConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in attrs.fields(RuntimeConfig)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--model", help="a model directory (default: the built-in --preset)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--span", type=int, default=256, help="tokens of the quoted span (repetitive) / half the prompt")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, default=4, help="--num-draft-tokens")
    p.add_argument("--ngram-k", type=int, nargs="*", default=[], metavar="K",
                   help="more n-gram arms, `ngram k=K`, at these --num-draft-tokens (the most a row drafts)")
    p.add_argument("--fixed-lengths", action="store_true",
                   help="beside each n-gram arm, `... fixed`: every row drafts K at every try "
                        "(MLXD_DRAFT_LENGTH=fixed: no per-row length from what verifying costs)")
    p.add_argument("--unbounded", action="store_true",
                   help="beside each n-gram arm, `... unbounded`: a step whose drafts could not pay even if all "
                        "were accepted verifies anyway (SpeculationGate.can_pay off: the engine before 2026-12-05)")
    p.add_argument("--draft", action="append", default=[], metavar="DIR",
                   help="also an arm with --speculative draft --draft-model DIR (repeatable; the model itself = "
                        "the upper bound)")
    p.add_argument("--no-repeat-check", dest="repeat_check", action="store_false",
                   help="skip running speculation off twice per case (is the platform deterministic?)")
    p.add_argument("--draft-self", action="store_true",
                   help="also an arm with the model itself as its draft (acceptance 1.0: the upper bound)")
    p.add_argument("--prefix-lengths", type=int, nargs="*", default=[],
                   help="with --draft: prompt lengths whose draft-prefix recompute is timed (e.g. 256 1024)")
    p.add_argument("--cases", choices=("all", "none"), default="all",
                   help="none: only the draft-prefix timing (with --draft)")
    p.add_argument("--draft-preset", action="append", default=[], metavar="PRESET",
                   help="a built-in preset as a draft arm (same tokenizer as the other presets but `test`)")
    p.add_argument("--temperature", type=float, nargs="+", default=[2.0, 4.0],
                   help="of the non-repetitive workload (one case per value)")
    p.add_argument("--control", action="store_true",
                   help="also an arm `off2`: speculation off again, its own copy of the weights (the noise between "
                        "two equal arms, and what a second copy of the weights costs)")
    p.add_argument("--probe-all", action="store_true",
                   help="also, per draft arm but draft=self, a twin whose gate probes by verifying every row "
                        "(MLXD_DRAFT_PROBE_ROWS=0, as before the one-row unverified probe)")
    p.add_argument("--schedule", choices=("rounds", "pairs", "bracket"), default="rounds",
                   help="rounds: every arm once a round, in rotating order, each compared with the round's off run; "
                        "pairs: each arm beside an off run of its own, off first every other pair; bracket: off, A, "
                        "off, B, ... each arm compared with the mean of the off runs either side (no core twice in a "
                        "row)")
    p.add_argument("--case-seconds", type=float, default=0.0, metavar="S",
                   help="start no round of a case after S seconds of it (3 rounds at least; 0: --rounds rounds)")
    p.add_argument("--budget", type=float, default=0.0, metavar="S",
                   help="seconds the cases may take from the loads' start: each case, its warm-up included, ends its "
                        "rounds by its share of what is left (a round that would not fit is not started; 3 rounds "
                        "at least); 0: no budget")
    p.add_argument("--workloads", nargs="+", choices=("repetitive", "non-repetitive"),
                   default=["repetitive", "non-repetitive"], help="which workloads run (default: both)")
    p.add_argument("--stop-after", type=float, default=0.0, metavar="S",
                   help="start no case after S seconds from the loads' start (0: run every case)")
    parsed = p.parse_args()
    parsed.draft += [str(ensure_model(name)) for name in parsed.draft_preset]
    if parsed.draft_self:
        parsed.draft.insert(0, parsed.model or str(ensure_model(parsed.preset)))
    parsed.result = RESULTS / f"speculative-{time.strftime('%Y%m%d-%H%M%S')}.json"
    save(main(parsed), parsed.result)
    print(parsed.result)
