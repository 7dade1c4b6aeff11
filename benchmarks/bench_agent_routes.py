"""Tool loops on the three agent routes: cached tokens per step, side by side.

    python benchmarks/bench_agent_routes.py [--steps 20]
    python benchmarks/bench_agent_routes.py --preset default --steps 8 --result-tokens 300

One in-process server (the scripted model of tests/scripted_model.py, whose
greedy decoding makes a real tool call at every step) runs the same
--steps-step tool loop over `/v1/chat/completions`, `/v1/messages` and
`/v1/responses` (the last through `previous_response_id`), the same
conversation on a fresh server per route. Per step it prints each route's
prompt tokens and cached tokens, and the ratio cached ÷ ideal, where ideal
is the reusable prefix: the previous step's prompt plus its reply (capped
below the new prompt). The three routes render the same prompt at each step
when their conversations are the same, so their numbers should agree.

TTFT: each step is first sent with one output token (timed; its cached
tokens are the step's reuse), then for real. Its time is compared with a
one-token text completion of as many fresh random token ids as the step had
to prefill (median of 3): the step's new tokens alone, without the history.

With --preset, the model is a built-in random-weight one (larger, so a step's
prefill is real work): the client sends recorded tool calls and tool results
of --result-tokens, and only the probe runs per step (ideal = the previous
step's prompt, since the reply is not part of the next prompt).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
from scripted_model import build_scripted_model  # noqa: E402

from serving import ServerThread, config_for  # noqa: E402

SYSTEM = "You are a careful coding agent. Use the tools to answer. " * 20
TOOL = {"name": "get_weather", "description": "The current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


class Timer:
    """TTFT of a step: its request with one output token, timed, before the step's real request.

    The probe is the first to see the step's prompt, so its cached tokens are the step's reuse; the
    baseline is a text completion of as many fresh random token ids as the probe had to prefill.
    """

    def __init__(self, http: httpx.Client, vocab: int, seed: int) -> None:
        self.http = http
        self.vocab = vocab
        self.rng = random.Random(seed)

    def probe(self, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        r = self.http.post(path, json=body)
        elapsed = time.perf_counter() - t0
        r.raise_for_status()
        return elapsed, r.json()["usage"]

    def alone(self, n: int, rounds: int = 3) -> float:
        """Median time of a 1-token completion over `n` new random ids (nothing of them cached)."""
        times = []
        for _ in range(rounds):
            ids = [self.rng.randrange(300, self.vocab) for _ in range(max(1, n))]
            t0 = time.perf_counter()
            self.http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 1}).raise_for_status()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def chat_loop(http: httpx.Client, timer: Timer, question: str, steps: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    out = []
    for step in range(steps):
        body = {"model": "tiny", "messages": messages, "tools": [{"type": "function", "function": TOOL}],
                "max_tokens": 40, "temperature": 0}
        ttft, u = timer.probe("/v1/chat/completions", {**body, "max_tokens": 1})
        r = http.post("/v1/chat/completions", json=body).json()
        out.append({"prompt": u["prompt_tokens"], "cached": u["prompt_tokens_details"]["cached_tokens"],
                    "completion": r["usage"]["completion_tokens"], "ttft": ttft,
                    "alone": timer.alone(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"])})
        message = r["choices"][0]["message"]
        messages.append({"role": "assistant", "content": message["content"] or "",
                         "tool_calls": message.get("tool_calls") or []})
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"sunny, {step} C"})
    return out


def messages_loop(http: httpx.Client, timer: Timer, question: str, steps: int) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = [{"role": "user", "content": question}]
    tool = {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
    out = []
    for step in range(steps):
        body = {"model": "tiny", "system": SYSTEM, "messages": turns, "tools": [tool], "max_tokens": 40,
                "temperature": 0}
        ttft, u = timer.probe("/v1/messages", {**body, "max_tokens": 1})
        r = http.post("/v1/messages", json=body).json()
        out.append({"prompt": u["input_tokens"] + u["cache_read_input_tokens"],
                    "cached": u["cache_read_input_tokens"], "completion": r["usage"]["output_tokens"],
                    "ttft": ttft, "alone": timer.alone(u["input_tokens"])})
        turns.append({"role": "assistant", "content": r["content"]})
        turns.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b["id"], "content": f"sunny, {step} C"}
            for b in r["content"] if b["type"] == "tool_use"]})
    return out


def responses_loop(http: httpx.Client, timer: Timer, question: str, steps: int) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"model": "tiny", "instructions": SYSTEM, "input": question,
                            "tools": [{"type": "function", **TOOL}], "max_output_tokens": 40, "temperature": 0}
    out = []
    for step in range(steps):
        ttft, u = timer.probe("/v1/responses", {**body, "max_output_tokens": 1, "store": False})
        r = http.post("/v1/responses", json=body).json()
        cached = u["input_tokens_details"]["cached_tokens"]
        out.append({"prompt": u["input_tokens"], "cached": cached, "completion": r["usage"]["output_tokens"],
                    "ttft": ttft, "alone": timer.alone(u["input_tokens"] - cached)})
        body = {**body, "previous_response_id": r["id"], "input": [
            {"type": "function_call_output", "call_id": item["call_id"], "output": f"sunny, {step} C"}
            for item in r["output"] if item["type"] == "function_call"]}
    return out


def recorded_loop(http: httpx.Client, timer: Timer, route: str, steps: int, results: list[str]) -> list[dict[str, Any]]:
    """--preset: a random-weight model, the session's tool calls recorded (sent by the client) and long
    tool results; only the one-token probe runs per step (the reply is not part of the next prompt)."""
    history: list[tuple[dict[str, Any], str]] = []  # (call arguments, result) per step
    out = []
    for step in range(steps):
        if route == "chat":
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": "Weather in Oslo, step by step?"}]
            for i, (args, result) in enumerate(history):
                messages.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{i}", "type": "function",
                                 "function": {"name": TOOL["name"], "arguments": json.dumps(args)}}]})
                messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": result})
            ttft, u = timer.probe("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 1,
                                  "tools": [{"type": "function", "function": TOOL}], "temperature": 0})
            prompt, cached = u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
        elif route == "messages":
            turns: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo, step by step?"}]
            for i, (args, result) in enumerate(history):
                turns.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"call_{i}",
                                                                "name": TOOL["name"], "input": args}]})
                turns.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"call_{i}",
                                                           "content": result}]})
            tool = {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
            ttft, u = timer.probe("/v1/messages", {"model": "tiny", "system": SYSTEM, "messages": turns,
                                                   "tools": [tool], "max_tokens": 1, "temperature": 0})
            prompt, cached = u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
        else:
            items: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo, step by step?"}]
            for i, (args, result) in enumerate(history):
                items.append({"type": "function_call", "call_id": f"call_{i}", "name": TOOL["name"],
                              "arguments": json.dumps(args)})
                items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": result})
            ttft, u = timer.probe("/v1/responses", {"model": "tiny", "instructions": SYSTEM, "input": items,
                                                    "tools": [{"type": "function", **TOOL}], "store": False,
                                                    "max_output_tokens": 1, "temperature": 0})
            prompt, cached = u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
        out.append({"prompt": prompt, "cached": cached, "completion": 0, "ttft": ttft,
                    "alone": timer.alone(prompt - cached)})
        history.append(({"city": f"city {step}"}, results[step]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--preset", help="a built-in random-weight model instead of the scripted one: tool "
                        "calls recorded, tool results of --result-tokens")
    parser.add_argument("--result-tokens", type=int, default=300)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if args.preset:
            from bench_serving import TextMaker

            from mlxd.model import build_model

            model = build_model(Path(tmp) / "model", args.preset, seed=0)
            maker = TextMaker(model)
            results = [maker.make(1000 + i, args.result_tokens) for i in range(args.steps)]
        else:
            model = build_scripted_model(Path(tmp) / "model")
        runs = {}
        for route, loop in (("chat", chat_loop), ("messages", messages_loop), ("responses", responses_loop)):
            # A fresh server per route: the same conversation, nothing cached by another route.
            with ServerThread(config_for(model, model_name="tiny")) as server, \
                    httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=300) as http:
                timer = Timer(http, server.runtime.info.vocab_size, seed=len(runs))
                if args.preset:
                    runs[route] = recorded_loop(http, timer, route, args.steps, results)
                else:
                    runs[route] = loop(http, timer, "Weather in Oslo, step by step?", args.steps)
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
    print(f"{'step':>4} " + " ".join(f"{r + ' TTFT / new tokens alone (ms)':>34}" for r in runs))
    ttft_ratios: dict[str, list[float]] = {r: [] for r in runs}
    for k in range(args.steps):
        cells = []
        for route, steps in runs.items():
            s = steps[k]
            ttft_ratios[route].append(s["ttft"] / s["alone"])
            cells.append(f"{s['ttft'] * 1e3:>10.1f} / {s['alone'] * 1e3:>7.1f} = {s['ttft'] / s['alone']:>5.2f}x")
        print(f"{k:>4} " + " ".join(f"{c:>34}" for c in cells))
    ttft = {r: {"median_ratio_steps_1_on": statistics.median(v[1:]), "min": min(v[1:]), "max": max(v[1:]),
                "step_0": v[0]} for r, v in ttft_ratios.items()}
    print("step TTFT ÷ the prefill of its new tokens alone:", json.dumps(ttft, indent=1))
    same = all(len({runs[r][k]["prompt"] for r in runs}) == 1 for k in range(args.steps))
    summary = {r: {"median": statistics.median(v), "min": min(v), "sum_cached_over_sum_ideal": sum(
        runs[r][k]["cached"] for k in range(1, args.steps)) / sum(
        min(runs[r][k - 1]["prompt"] + runs[r][k - 1]["completion"], runs[r][k]["prompt"] - 1)
        for k in range(1, args.steps))} for r, v in ratios.items()}
    print("cached ÷ ideal over steps 1..:", json.dumps(summary, indent=1))
    print("same prompt tokens on every route at every step:", same)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"agent_routes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"steps": args.steps, "preset": args.preset or "scripted",
                                "result_tokens": args.result_tokens if args.preset else None, "runs": runs, "summary": summary, "ttft": ttft,
                                "same_prompts": same},
                               indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
