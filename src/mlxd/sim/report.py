"""Print and save simulation results: a summary table, JSON, and PNG plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from mlxd.sim.results import RunResult

GB = 1e9


def _cap(r: RunResult) -> str:
    return "inf" if r.capacity_blocks is None else str(r.capacity_blocks)


def table(results: Sequence[RunResult]) -> str:
    """A fixed-width summary, one row per run."""
    head = (
        f"{'model':6} {'policy':6} {'blocks':>7} {'tok hit':>7} {'req hit':>7} "
        f"{'ram':>6} {'ssd':>6} {'miss':>6} {'ssdW GB':>8} {'ssdR GB':>8} {'ssdK GB':>8} "
        f"{'evict':>7} {'demote':>7} {'ttft p50':>9} {'ttft p99':>9} {'wall s':>6}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{r.cache_model:6} {r.policy:6} {_cap(r):>7} {r.token_hit_rate:7.3f} "
            f"{r.mean_request_hit_rate:7.3f} {r.ram_hits:6d} {r.ssd_hits:6d} {r.misses:6d} "
            f"{r.ssd_bytes_written / GB:8.1f} {r.ssd_bytes_read / GB:8.1f} {r.ssd_bytes_retained / GB:8.1f} "
            f"{r.evictions:7d} "
            f"{r.demotions:7d} {r.ttft_s['p50']:9.2f} {r.ttft_s['p99']:9.2f} {r.wall_s:6.1f}"
        )
    return "\n".join(rows)


def ram_pages_table(results: Sequence[RunResult]) -> str:
    """The RAM tier's bytes per mlxd run (--ram-pages): held at the end and at the most (pages once), and
    what the end's entries would hold as contiguous entries."""
    head = (
        f"{'policy':6} {'blocks':>7} {'ram':>10} {'tok hit':>7} {'RAM GB':>8} {'peak GB':>8} "
        f"{'contig GB':>9} {'ratio':>6}"
    )
    rows = ["RAM retained: pages vs contiguous entries", head, "-" * len(head)]
    for r in results:
        if r.cache_model != "mlxd":
            continue
        ratio = r.ram_checkpoint_bytes / r.ram_bytes_retained if r.ram_bytes_retained else 0.0
        rows.append(
            f"{r.policy:6} {_cap(r):>7} {'pages' if r.ram_pages else 'contiguous':>10} {r.token_hit_rate:7.3f} "
            f"{r.ram_bytes_retained / GB:8.3f} {r.ram_bytes_peak / GB:8.3f} {r.ram_checkpoint_bytes / GB:9.3f} "
            f"{ratio:5.2f}x"
        )
    return "\n".join(rows)


def admission_table(results: Sequence[RunResult]) -> str:
    """Admission by KV bytes per run that applied it: admissions that waited for memory (and, replaying a
    recording, how many the recorded server held back), refusals, the most bytes reserved at once."""
    head = f"{'policy':6} {'blocks':>7} {'waited':>7} {'recorded':>8} {'refused':>7} {'peak MiB':>9}"
    rows = ["admission by KV bytes", head, "-" * len(head)]
    for r in results:
        if r.kv_admission:
            rows.append(
                f"{r.policy:6} {_cap(r):>7} {r.kv_waited:7d} {r.kv_waited_recorded:8d} {r.kv_refused:7d} "
                f"{r.kv_peak_reserved_bytes / 2**20:9.1f}"
            )
    return "\n".join(rows)


def session_table(pairs: Sequence[tuple[RunResult, RunResult]], sessions: int) -> str:
    """What the session index changes: each mlxd run with the index against its twin without."""
    head = (
        f"session index ({sessions} sessions in the trace): with vs without\n"
        f"{'policy':6} {'blocks':>7} {'sess hit':>8} {'fallback':>8} {'tok hit':>15} {'ram hits':>13} "
        f"{'evict':>13} {'ttft p50':>15}"
    )
    rows = [head, "-" * len(head.splitlines()[-1])]
    for w, wo in pairs:
        rows.append(
            f"{w.policy:6} {_cap(w):>7} {w.session_hits:8d} {w.session_fallbacks:8d} "
            f"{w.token_hit_rate:7.3f}/{wo.token_hit_rate:<7.3f} {w.ram_hits:6d}/{wo.ram_hits:<6d} "
            f"{w.evictions:6d}/{wo.evictions:<6d} {w.ttft_s['p50']:7.2f}/{wo.ttft_s['p50']:<7.2f}"
        )
    return "\n".join(rows)


def session_json(pairs: Sequence[tuple[RunResult, RunResult]], sessions: int) -> dict:
    return {
        "sessions": sessions,
        "runs": [{"with": w.to_json(), "without": wo.to_json()} for w, wo in pairs],
    }


def json_lines(results: Sequence[RunResult]) -> str:
    return "\n".join(json.dumps(r.to_json(), sort_keys=True) for r in results)


def save(
    out: Path, results: Sequence[RunResult], meta: dict, *, name: str = "results"
) -> list[Path]:
    """Write `<name>.json` and the plots into `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(
        json.dumps({"meta": meta, "runs": [r.to_json() for r in results]}, indent=1) + "\n"
    )
    return [path, *plot(out, results, name=name, title=meta.get("trace", ""))]


def _series(results, key):
    """{(cache_model, policy): [(capacity, value), ...]} over finite capacities, sorted."""
    out: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in results:
        if r.capacity_blocks is not None:
            out.setdefault((r.cache_model, r.policy), []).append((r.capacity_blocks, key(r)))
    return {k: sorted(v) for k, v in out.items()}


def plot(out: Path, results: Sequence[RunResult], *, name: str, title: str) -> list[Path]:
    """Hit rate vs capacity, RAM/SSD/miss split, TTFT percentiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (axes[0], lambda r: r.token_hit_rate, "token-weighted hit rate"),
        (axes[1], lambda r: r.mean_request_hit_rate, "mean per-request hit fraction"),
    ):
        for (model, policy), pts in _series(results, key).items():
            style = "-" if model == "mlxd" else "--"
            ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{model} {policy}")
        for r in results:  # unlimited capacity as a horizontal reference
            if r.capacity_blocks is None and r.cache_model == "blocks" and r.policy == "lru":
                ax.axhline(key(r), color="gray", lw=0.8, ls=":", label="blocks unlimited")
        ax.set_xscale("log")
        ax.set_xlabel("RAM capacity (512-token blocks)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}: hit rate vs capacity")
    fig.tight_layout()
    paths.append(_savefig(fig, out / f"{name}_hit_rate.png"))

    runs = [r for r in results if r.cache_model == "mlxd"] or list(results)
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(runs)), 4))
    labels = [f"{r.policy}\n{_cap(r)}" for r in runs]
    ram = [r.ram_hit_tokens / max(r.input_tokens, 1) for r in runs]
    ssd = [r.ssd_hit_tokens / max(r.input_tokens, 1) for r in runs]
    miss = [1 - a - b for a, b in zip(ram, ssd, strict=True)]
    xs = range(len(runs))
    ax.bar(xs, ram, label="RAM hit tokens")
    ax.bar(xs, ssd, bottom=ram, label="SSD hit tokens")
    ax.bar(xs, miss, bottom=[a + b for a, b in zip(ram, ssd, strict=True)], label="prefilled")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("fraction of prompt tokens")
    ax.legend(fontsize=7)
    ax.set_title(f"{title}: RAM / SSD / miss split ({runs[0].cache_model if runs else ''} model)")
    fig.tight_layout()
    paths.append(_savefig(fig, out / f"{name}_split.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for p, style in (("p50", "-"), ("p99", "--")):
        for (model, policy), pts in _series(results, lambda r, p=p: r.ttft_s[p]).items():
            ax.plot(*zip(*pts, strict=True), style, marker=".", label=f"{model} {policy} {p}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("RAM capacity (512-token blocks)")
    ax.set_ylabel("TTFT under the cost model (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(f"{title}: TTFT percentiles")
    fig.tight_layout()
    paths.append(_savefig(fig, out / f"{name}_ttft.png"))
    return paths


def _savefig(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
