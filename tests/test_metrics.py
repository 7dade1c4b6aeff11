"""`GET /metrics` of a live server: Prometheus text that moves with the traffic."""

from __future__ import annotations

import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import ServerThread, config_for

SYSTEM = "Count the tokens your cache saves you. " * 12
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How many?"}]
NAME = re.compile(r"^mlxd_[a-z0-9_]+$")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("ssd")
    with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=ssd)) as s:
        yield s


def root(server: ServerThread) -> str:
    return server.base_url.removesuffix("/v1")


def chat(server: ServerThread) -> dict:
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 5}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def scrape(server: ServerThread) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    """(family name -> type, (sample name, sorted labels) -> value)."""
    r = httpx.get(f"{root(server)}/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    types, samples = {}, {}
    for family in text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_requests_cache_hits_and_flushes(server):
    _, before = scrape(server)
    first = chat(server)
    second = chat(server)  # the same prompt again: a RAM hit
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and cached > 0
    flush = httpx.post(f"{root(server)}/admin/cache/flush", timeout=120)
    assert flush.status_code == 200
    _, after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("mlxd_requests_finished_total", reason="length") == 2
    assert moved("mlxd_requests_submitted_total") == 2
    assert moved("mlxd_request_ttft_seconds_count") == 2
    assert moved("mlxd_request_duration_seconds_count") == 2
    assert moved("mlxd_request_time_per_output_token_seconds_count") == 2
    assert moved("mlxd_request_ttft_seconds_sum") > 0
    assert moved("mlxd_request_prompt_tokens_sum") == 2 * first["usage"]["prompt_tokens"]
    assert moved("mlxd_generated_tokens_total") == 10
    assert moved("mlxd_cache_requests_total", tier="none") == 1
    assert moved("mlxd_cache_requests_total", tier="ram") == 1
    assert moved("mlxd_cache_reused_tokens_total", tier="ram") == cached
    assert moved("mlxd_cached_prompt_tokens_total") == cached
    assert moved("mlxd_ram_cache_lookups_total", result="hit") == 1
    assert moved("mlxd_flushes_total", outcome="durable") == 1
    assert moved("mlxd_ssd_written_bytes_total") > 0
    assert moved("mlxd_ssd_spills_total", outcome="written") >= 1
    assert value(after, "mlxd_ssd_pending_writes") == 0  # the flush waited for every write
    assert value(after, "mlxd_cache_entries", tier="ram") >= 1
    assert value(after, "mlxd_cache_entries", tier="ssd") >= 1
    assert value(after, "mlxd_cache_bytes", tier="ssd") > 0
    assert value(after, "mlxd_model_info", model="tiny") == 1
    assert value(after, "mlxd_queue_capacity") == server.config.max_queue
    assert value(after, "mlxd_batch_capacity") == server.config.max_batch
    assert value(after, "mlxd_channel_capacity", channel="submit") == server.config.max_queue


def test_names_follow_prometheus_conventions(server):
    chat(server)
    types, samples = scrape(server)
    assert len(types) > 40
    for name, kind in types.items():
        assert NAME.match(name), name
        if kind == "counter":
            assert not name.endswith("_total"), f"{name}: the parser strips _total"
            assert (name + "_total", ()) in samples or any(s[0] == name + "_total" for s in samples), name
        if kind == "gauge":
            assert not name.endswith("_total"), f"gauge {name} must not end in _total"
        if kind == "histogram":
            assert name.endswith(("_seconds", "_tokens")), f"histogram {name} needs a unit suffix"
    for name, _ in samples:
        if "byte" in name:
            assert name.endswith(("_bytes", "_bytes_total")), f"{name}: byte quantities end in _bytes"
        if "second" in name:
            assert re.search(r"_seconds(_total|_sum|_count|_bucket|_created)?$", name), name


def test_each_runtime_has_its_own_registry(server, tiny_model_dir):
    chat(server)
    with ServerThread(config_for(tiny_model_dir)) as other:
        types, samples = scrape(other)
    assert value(samples, "mlxd_requests_submitted_total") == 0
    assert value(samples, "mlxd_request_ttft_seconds_count") == 0
    assert "mlxd_ssd_written_bytes" not in types  # no SSD tier on this one
    assert value(samples, "mlxd_cache_requests_total", tier="none") == 0
