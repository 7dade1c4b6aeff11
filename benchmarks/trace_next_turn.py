"""A next turn and a hit, stage by stage, mlxd beside mlx_lm.server (issue 28; CPU or GPU).

    python benchmarks/trace_next_turn.py --preset test --prompt-tokens 16384 --rounds 3
    # an older mlxd beside this one (its src/ on the server's PYTHONPATH), e.g. before a change:
    python benchmarks/trace_next_turn.py --servers mlxd,mlxd_before,mlx_lm --before-src /tmp/old/src

Per round, on each server in turn: a first prompt of `--prompt-tokens` tokens (cold), the same again
(hit: one token to prefill), the next turn (the reply and a short question: ~30 new tokens after a
prefix hit) and the next turn again (a hit whose history holds a reply). The client's time to the
first content token, and from mlxd's request log (request.http, request.done's first_token_ms) where
the server's part went: the table printed is the median of each stage per turn kind (ms). The
`test` preset makes the model's own compute small, so a fixed host cost per token shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))
sys.path.insert(0, str(HERE))

from bench_gpu import Proc, built, done_lines, log, text_of, ttft  # noqa: E402
from bench_host_tier_servers import TEXTS, client_gaps, median, stage_rows  # noqa: E402

from mlxd.model import presets  # noqa: E402

TURNS = ("hit", "next", "next_hit")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="test")
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--servers", default="mlxd,mlx_lm",
                    help="mlxd, mlxd_before (--before-src), mlxd_apart, mlxd_handover, mlxd_both, mlx_lm")
    ap.add_argument("--before-src", default=None, help="an older mlxd's src/ directory (the mlxd_before server)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/trace-next-turn"))
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = built(presets.PRESETS[args.preset], args.work)
    py = sys.executable
    mlxd = [py, "-m", "mlxd.cli", "serve", "--model", str(model_dir), "--log-format", "json", "--prompt-cache-gb", "4",
            "--device-probe", "off", "--queue-timeout", "0"]
    cmds = {"mlxd": (mlxd + ["--port", "18311"], 18311, None),
            # the arms off by default, on this code (engine/core.py SUFFIX_APART, model/batch_handover.py)
            "mlxd_apart": (["env", "MLXD_SUFFIX_APART=256", *mlxd, "--port", "18314"], 18314, None),
            "mlxd_handover": (["env", "MLXD_BATCH_HANDOVER=1", *mlxd, "--port", "18315"], 18315, None),
            "mlxd_both": (["env", "MLXD_BATCH_HANDOVER=1", "MLXD_SUFFIX_APART=256", *mlxd, "--port", "18316"], 18316,
                          None),
            "mlxd_before": (mlxd + ["--port", "18312"], 18312, args.before_src),
            "mlx_lm": ([py, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", "18313", "--log-level",
                        "WARNING"], 18313, None)}
    wanted = [w for w in args.servers.split(",") if w]
    out: dict[str, Any] = {"argv": sys.argv, "tokens": args.prompt_tokens, "preset": args.preset,
                           "load_before": os.getloadavg()}
    prompts = [text_of(model_dir, args.prompt_tokens, 700 + r) for r in range(args.rounds)]
    for name in wanted:
        cmd, port, src = cmds[name]
        logpath = args.work / f"{name}.log"
        logpath.unlink(missing_ok=True)
        if src is not None:
            os.environ["PYTHONPATH"] = src + os.pathsep + os.environ.get("PYTHONPATH", "")
        s = Proc(name, cmd, port, "/v1/models" if name == "mlx_lm" else "/health", logpath)
        try:
            s.start(timeout=300)
        finally:
            if src is not None:
                os.environ["PYTHONPATH"] = os.environ["PYTHONPATH"].split(os.pathsep, 1)[1]
        model = "default_model" if name == "mlx_lm" else model_dir.name
        rows: list[dict[str, Any]] = []
        try:
            asyncio.run(ttft(s.base, model, "warm up " * 20))
            for a in prompts:
                hist = [{"role": "user", "content": a}]
                row = {"cold": asyncio.run(ttft(s.base, model, hist)), "hit": asyncio.run(ttft(s.base, model, hist))}
                hist += [{"role": "assistant", "content": row["hit"]["text"]}, {"role": "user", "content": TEXTS["q2"]}]
                row["next"] = asyncio.run(ttft(s.base, model, hist))
                row["next_hit"] = asyncio.run(ttft(s.base, model, hist))
                rows.append(row)
                log(name, " ".join(f"{k} {row[k]['ttft_s'] * 1000:.1f}ms/{row[k]['cached_tokens']}"
                                   for k in ("cold", *TURNS)))
        finally:
            s.stop()
        out[name] = {"rows": rows, "stages_ms": server_stages(rows, done_lines(logpath) if name != "mlx_lm" else [])}
    out["load_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    res = args.out / f"next_turn-{args.preset}-{args.prompt_tokens}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    res.write_text(json.dumps(out, indent=1, default=str))
    print_table(out, wanted)
    log("->", res)
    return 0


def server_stages(rows: list[dict[str, Any]], lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Each turn kind's stages (median ms), matching the server's lines to the client's turns in order."""
    done = [x for x in lines if x.get("event") == "request.done"]
    http = {x.get("request_id"): x for x in lines if x.get("event") == "request.http"}
    found: dict[str, list[dict[str, Any]]] = {k: [] for k in TURNS}
    for row in rows:
        for k in TURNS:
            c = row[k]
            hit = next((x for x in done if x.get("prompt_tokens") == c.get("prompt_tokens")
                        and x.get("cached_tokens") == c.get("cached_tokens")), None)
            turn: dict[str, Any] = {"client_s": c["ttft_s"]}
            if hit is not None:
                done.remove(hit)
                turn |= {f: hit.get(f) for f in ("ttft_ms", "queued_ms", "lookup_ms", "first_token_ms")}
                turn |= client_gaps(c, http.get(hit.get("request_id")))
            found[k].append(turn)
    return {k: stage_rows(v) for k, v in found.items()}


def print_table(out: dict[str, Any], wanted: list[str]) -> None:
    cols = [(f"{name}:{k}", out[name]["stages_ms"][k]) for name in wanted if name in out for k in TURNS]
    keys = list(cols[0][1]) if cols else []
    print("stages (median ms)".ljust(22) + "".join(c[0][-18:].rjust(19) for c in cols), flush=True)
    for key in keys:
        vals = [c[1].get(key) for c in cols]
        if all(v is None for v in vals):
            continue
        print(key.ljust(22) + "".join(("-" if v is None else f"{v:.2f}").rjust(19) for v in vals), flush=True)
    for name in wanted:
        if name != "mlx_lm" and "mlx_lm" in out and name in out:
            ratios = []
            for k in TURNS:
                pairs = [a[k]["ttft_s"] / b[k]["ttft_s"] for a, b in zip(out[name]["rows"], out["mlx_lm"]["rows"],
                                                                        strict=False)]
                ratios.append(f"{k} {median(pairs):.2f} ({', '.join(f'{p:.2f}' for p in pairs)})")
            print(f"{name} / mlx_lm client, per round: " + "; ".join(ratios), flush=True)


if __name__ == "__main__":
    sys.exit(main())
