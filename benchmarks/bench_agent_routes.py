"""Tool loops on the three agent routes: cached tokens per step, side by side.

    python benchmarks/bench_agent_routes.py [--steps 20]

One in-process server (the scripted model of tests/scripted_model.py, whose
greedy decoding makes a real tool call at every step) runs the same
--steps-step tool loop over `/v1/chat/completions`, `/v1/messages` and
`/v1/responses` (the last through `previous_response_id`), the same
conversation on a fresh server per route. Per step it prints each route's
prompt tokens and cached tokens, and the ratio cached ÷ ideal, where ideal
is the reusable prefix: the previous step's prompt plus its reply (capped
below the new prompt). The three routes render the same prompt at each step
when their conversations are the same, so their numbers should agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from scripted_model import build_scripted_model  # noqa: E402

from serving import ServerThread, config_for  # noqa: E402

SYSTEM = "You are a careful coding agent. Use the tools to answer. " * 20
TOOL = {"name": "get_weather", "description": "The current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def chat_loop(http: httpx.Client, question: str, steps: int) -> list[dict[str, int]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    out = []
    for step in range(steps):
        r = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "tools": [{"type": "function", "function": TOOL}],
            "max_tokens": 40, "temperature": 0}).json()
        u = r["usage"]
        out.append({"prompt": u["prompt_tokens"], "cached": u["prompt_tokens_details"]["cached_tokens"],
                    "completion": u["completion_tokens"]})
        message = r["choices"][0]["message"]
        messages.append({"role": "assistant", "content": message["content"] or "",
                         "tool_calls": message.get("tool_calls") or []})
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"sunny, {step} C"})
    return out


def messages_loop(http: httpx.Client, question: str, steps: int) -> list[dict[str, int]]:
    turns: list[dict[str, Any]] = [{"role": "user", "content": question}]
    tool = {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
    out = []
    for step in range(steps):
        r = http.post("/v1/messages", json={"model": "tiny", "system": SYSTEM, "messages": turns, "tools": [tool],
                                            "max_tokens": 40, "temperature": 0}).json()
        u = r["usage"]
        out.append({"prompt": u["input_tokens"] + u["cache_read_input_tokens"],
                    "cached": u["cache_read_input_tokens"], "completion": u["output_tokens"]})
        turns.append({"role": "assistant", "content": r["content"]})
        turns.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b["id"], "content": f"sunny, {step} C"}
            for b in r["content"] if b["type"] == "tool_use"]})
    return out


def responses_loop(http: httpx.Client, question: str, steps: int) -> list[dict[str, int]]:
    body: dict[str, Any] = {"model": "tiny", "instructions": SYSTEM, "input": question,
                            "tools": [{"type": "function", **TOOL}], "max_output_tokens": 40, "temperature": 0}
    out = []
    for step in range(steps):
        r = http.post("/v1/responses", json=body).json()
        u = r["usage"]
        out.append({"prompt": u["input_tokens"], "cached": u["input_tokens_details"]["cached_tokens"],
                    "completion": u["output_tokens"]})
        body = {**body, "previous_response_id": r["id"], "input": [
            {"type": "function_call_output", "call_id": item["call_id"], "output": f"sunny, {step} C"}
            for item in r["output"] if item["type"] == "function_call"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model = build_scripted_model(Path(tmp) / "model")
        runs = {}
        for route, loop in (("chat", chat_loop), ("messages", messages_loop), ("responses", responses_loop)):
            # A fresh server per route: the same conversation, nothing cached by another route.
            with ServerThread(config_for(model, model_name="tiny")) as server, \
                    httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=300) as http:
                runs[route] = loop(http, "Weather in Oslo, step by step?", args.steps)
    print(f"{'step':>4} " + " ".join(f"{r + ' prompt/cached/ratio':>34}" for r in runs))
    ratios: dict[str, list[float]] = {r: [] for r in runs}
    for k in range(args.steps):
        cells = []
        for route, steps in runs.items():
            s = steps[k]
            if k == 0:
                cells.append(f"{s['prompt']:>14}/{s['cached']:>6}/{'-':>11}")
                continue
            prev = steps[k - 1]
            ideal = min(prev["prompt"] + prev["completion"], s["prompt"] - 1)
            ratio = s["cached"] / ideal
            ratios[route].append(ratio)
            cells.append(f"{s['prompt']:>14}/{s['cached']:>6}/{ratio:>11.3f}")
        print(f"{k:>4} " + " ".join(f"{c:>34}" for c in cells))
    same = all(len({runs[r][k]["prompt"] for r in runs}) == 1 for k in range(args.steps))
    summary = {r: {"median": statistics.median(v), "min": min(v), "sum_cached_over_sum_ideal": sum(
        runs[r][k]["cached"] for k in range(1, args.steps)) / sum(
        min(runs[r][k - 1]["prompt"] + runs[r][k - 1]["completion"], runs[r][k]["prompt"] - 1)
        for k in range(1, args.steps))} for r, v in ratios.items()}
    print("cached ÷ ideal over steps 1..:", json.dumps(summary, indent=1))
    print("same prompt tokens on every route at every step:", same)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"agent_routes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"steps": args.steps, "runs": runs, "summary": summary, "same_prompts": same},
                               indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
