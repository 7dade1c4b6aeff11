"""Two mlxd replicas behind SMG's cache-aware policy: a conversation stays where its cache is."""

from __future__ import annotations

from collections import defaultdict
from contextlib import ExitStack

from gateway import Gateway
from procs import ServeProcess

TOPICS = ("astronomy", "baking", "chess", "databases")


def system_prompt(topic: str) -> str:
    # Distinct from the first token on, so the gateway's prefix tree tells them apart.
    return f"{topic.upper()} TUTOR. You explain {topic} carefully, step by step, to a patient student. " * 6


def chat(http, messages):
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6,
            "logit_bias": {"0": -100, "2": -100}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def test_cache_aware_gateway_keeps_each_conversation_on_one_replica(tmp_path, tiny_model_dir):
    with ExitStack() as stack:
        replicas = [
            stack.enter_context(ServeProcess("--model", str(tiny_model_dir), "--model-name", "tiny",
                                             log_path=tmp_path / f"replica{i}.log"))
            for i in range(2)
        ]
        urls = [r.url for r in replicas]
        gw = stack.enter_context(Gateway(urls, policy="cache_aware", log_path=tmp_path / "smg.log"))
        routed: dict[str, set[str]] = defaultdict(set)
        with gw.client() as http:
            conversations = {t: [{"role": "system", "content": system_prompt(t)},
                                 {"role": "user", "content": f"Where do I start with {t}?"}] for t in TOPICS}
            for turn in range(3):
                for topic, messages in conversations.items():
                    r = chat(http, messages)
                    body = r.json()
                    routed[topic].add(r.headers.get("x-smg-routed-worker-id", "?"))
                    if turn > 0:  # a follow-up: the replica holding the conversation served it from cache
                        usage = body["usage"]
                        assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] // 2, (
                            topic, turn, usage)
                    messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                                 {"role": "user", "content": "Go on."}]
        assert all(len(workers) == 1 for workers in routed.values()), dict(routed)
        assert {w for ws in routed.values() for w in ws} <= set(urls)
        # The replicas' own counters agree with the gateway's routing.
        per_replica = []
        for replica in replicas:
            with replica.client() as http:
                sched = http.get("/stats").json()["scheduler"]
                loads = http.get("/v1/loads", params={"include": "core,queues"}).json()
            per_replica.append(sched["completed"])
            assert loads["dp_rank_count"] == 1 and loads["loads"][0]["num_running_reqs"] == 0
            assert loads["mlxd"]["queue_depth"] == 0
            # A replica the gateway sent nothing to holds nothing (cache_aware may pick one for all).
            used = loads["mlxd"]["cache_utilization"]["ram"]
            assert (0 < used <= 1) if sched["completed"] else used == 0
        assert sum(per_replica) == 3 * len(TOPICS)
        for replica in replicas:
            expected = 3 * sum(1 for ws in routed.values() if replica.url in ws)
            with replica.client() as http:
                assert http.get("/stats").json()["scheduler"]["completed"] == expected
