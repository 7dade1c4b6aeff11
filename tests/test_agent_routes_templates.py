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

import sys
from pathlib import Path

import httpx
import pytest

from mlxd.model import build_model

from serving import ServerThread, config_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_agent_templates import TEMPLATE_FILES, run_loop, session  # noqa: E402

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
