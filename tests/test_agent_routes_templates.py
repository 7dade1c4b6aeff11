"""A tool loop with reasoning on real public chat templates serves the ideal reusable prefix (issue 25).

The short CI form of benchmarks/bench_agent_templates.py: a recorded agent session (reasoning and
one tool call per assistant turn, then its result) replayed over /v1/chat/completions on a server
started with `--chat-template` one of the vendored templates (benchmarks/templates/). At each step
the ideal is the common prefix of the step's prompt with the previous step's, both rendered by
the server's template.

- A trimmable cache (KVCache) serves exactly the ideal, also where DeepSeek-R1's template
  re-renders the end of the previous prompt (reuse up to the divergence).
- An untrimmable one (the hybrid gated delta-net + attention model) serves the previous step's
  prompt-boundary checkpoint when Qwen3's template keeps the prompt a prefix: every token but the
  last, which the step before prefilled together with its first output token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from mlxd.model import build_model

from serving import ServerThread, config_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_agent_templates import TEMPLATE_FILES, TOOLS, run_loop, session  # noqa: E402

STEPS = session(4, result_words=12)


def loop(model_dir: Path, template: str) -> list[dict]:
    config = config_for(model_dir, chat_template=str(TEMPLATE_FILES[template]))
    with ServerThread(config) as server, \
            httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=120) as http:
        return run_loop(server, http, STEPS, timed=False)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "hybrid", "test-qwen3next", seed=0)


def test_qwen3_template_keeps_the_prompt_a_prefix_and_kvcache_serves_all_of_it(tiny_model_dir):
    rows = loop(tiny_model_dir, "qwen3")
    assert all(r["prompt"] == r["rendered"] for r in rows)  # the server's prompt is the template's
    assert rows[0]["cached"] == 0
    for prev, row in zip(rows, rows[1:], strict=False):
        assert row["kept"] == 1.0  # reasoning and calls of this loop's turns are re-rendered as sent
        assert row["ideal"] == prev["prompt"]
        assert row["cached"] == row["ideal"]


def test_deepseek_r1_template_rerenders_the_tail_and_kvcache_reuses_up_to_the_divergence(tiny_model_dir):
    rows = loop(tiny_model_dir, "deepseek-r1")
    for prev, row in zip(rows, rows[1:], strict=False):
        # The generation prompt '<｜Assistant｜><think>\n' / '<｜tool▁outputs▁end｜>' is not in the next prompt.
        assert row["ideal"] < prev["prompt"]
        assert row["cached"] == row["ideal"]


def test_an_untrimmable_hybrid_cache_serves_all_but_the_last_token_of_each_step(hybrid_dir):
    rows = loop(hybrid_dir, "qwen3")
    for row in rows[1:]:
        assert row["kept"] == 1.0
        assert row["cached"] == row["ideal"] - 1
        assert row["cached"] / row["ideal"] >= 0.99


def greedy(server: ServerThread, http: httpx.Client, messages: list[dict]) -> tuple[str, int]:
    body = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 6, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    doc = r.json()
    return json.dumps(doc["choices"][0]["message"], sort_keys=True), doc["usage"]["prompt_tokens_details"][
        "cached_tokens"]


def test_an_untrimmable_hybrid_cache_reuses_deepseek_r1s_prompt_up_to_its_rewritten_tail(hybrid_dir):
    # DeepSeek-R1's template rewrites the last 2-20 tokens of each step's prompt in the next one;
    # the route finds that stable prefix and the engine checkpoints there (runtime/chat/stable_prefix.py).
    config = config_for(hybrid_dir, chat_template=str(TEMPLATE_FILES["deepseek-r1"]))
    with ServerThread(config) as server, \
            httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=120) as http:
        assert server.runtime is not None and not server.runtime.info.trimmable
        rows = run_loop(server, http, STEPS, timed=False)
        last = [*STEPS[-1], {"role": "user", "content": "Summarize."}]
        warm, warm_cached = greedy(server, http, last)
    for row in rows[1:]:
        assert row["ideal"] < row["rendered"]  # the template re-rendered the previous prompt's tail
        assert row["cached"] == row["ideal"]  # served up to the divergence
    assert warm_cached > 0
    with ServerThread(config) as cold_server, \
            httpx.Client(base_url=cold_server.base_url.removesuffix("/v1"), timeout=120) as http:
        cold, cold_cached = greedy(cold_server, http, last)
    assert cold_cached == 0
    assert warm == cold  # the cut changes where a checkpoint is published, never the output
