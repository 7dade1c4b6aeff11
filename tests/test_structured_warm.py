"""Compiled grammars across a restart: the SSD tier keeps the recent constraints, a restart compiles them first.

Unit: the list's round trip, its caps, and the files it ignores (corrupt, another version, another
model). Then a real server with `--ssd-cache`: one constrained request, SIGTERM, a restart on the same
directory finds the grammar compiled before its first request (a hit, no miss) and gives the same reply.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxd.kv import grammar_list
from mlxd.structured.matcher import GrammarCache, load_vocabulary
from mlxd.structured.spec import JSON_OBJECT, Constraint, constraint_from_request

from procs import ServeProcess

VOCAB = "model-a tok-1"
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}


def regex(i: int) -> Constraint:
    return Constraint("regex", f"[a-z]{{{i}}}")


def test_the_list_round_trips_in_order_of_use(tmp_path: Path) -> None:
    path = grammar_list.list_path(tmp_path / "fp")
    saved = [JSON_OBJECT, regex(1), constraint_from_request({"response_format": FORMAT}), Constraint("grammar",
                                                                                                       'start: "a"')]
    grammar_list.save(path, saved, VOCAB)
    assert grammar_list.load(path, VOCAB) == saved
    assert [p.name for p in path.parent.iterdir()] == [grammar_list.FILE_NAME]  # no tmp file left beside it


def test_the_list_keeps_the_most_recent_64_and_4_mb(tmp_path: Path) -> None:
    path = tmp_path / grammar_list.FILE_NAME
    many = [regex(i) for i in range(100)]
    grammar_list.save(path, many, VOCAB)
    assert grammar_list.load(path, VOCAB) == many[-64:]
    big = [Constraint("regex", "a" * (1 << 20) + str(i)) for i in range(6)]
    grammar_list.save(path, big, VOCAB)
    assert grammar_list.load(path, VOCAB) == big[-3:]  # a fourth would pass 4 MB of source
    assert path.stat().st_size < 4 << 20


@pytest.mark.parametrize("body", [b"", b"{not json", b"[1, 2]", b'{"version": 1, "vocabulary": "model-a tok-1"}',
                                  b'{"version": 1, "vocabulary": "model-a tok-1", "constraints": [{"kind": "x"}]}',
                                  b'{"version": 1, "vocabulary": "model-a tok-1", "constraints": '
                                  b'[{"kind": "sql", "source": "s"}]}', b"\xff\xfe"],
                         ids=["empty", "truncated", "a-list", "no-entries", "no-source", "unknown-kind", "not-utf8"])
def test_a_corrupt_list_is_empty(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / grammar_list.FILE_NAME
    path.write_bytes(body)
    assert grammar_list.load(path, VOCAB) == []


def test_another_version_or_model_or_no_file_is_empty(tmp_path: Path) -> None:
    path = tmp_path / grammar_list.FILE_NAME
    assert grammar_list.load(path, VOCAB) == []
    grammar_list.save(path, [regex(2)], VOCAB)
    assert grammar_list.load(path, "model-b tok-1") == []
    assert grammar_list.load(path, "model-a tok-2") == []
    data = json.loads(path.read_bytes())
    path.write_text(json.dumps({**data, "version": grammar_list.VERSION + 1}))
    assert grammar_list.load(path, VOCAB) == []


def test_a_warmed_grammar_is_a_hit_and_recent_keeps_the_order_of_use(tiny_model_dir: Path) -> None:
    cache = GrammarCache(load_vocabulary(tiny_model_dir))
    a, b = regex(3), JSON_OBJECT
    assert cache.warm(a) and cache.warm(b) and not cache.warm(a)
    assert not cache.warm(Constraint("regex", "(unclosed"))  # a source that does not compile is skipped
    assert cache.recent() == [a, b]
    cache.matcher(a)
    assert cache.recent() == [b, a]
    stats = cache.stats()
    assert (stats.entries, stats.hits, stats.misses, stats.warmed) == (2, 1, 0, 2)


def test_a_restart_on_the_same_ssd_cache_compiles_the_grammar_before_serving(tmp_path: Path,
                                                                              tiny_model_dir: Path) -> None:
    ssd = tmp_path / "ssd"
    args = ("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(ssd))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Plan a trip as JSON."}],
            "max_tokens": 60, "temperature": 0, "response_format": FORMAT}

    with ServeProcess(*args, log_path=tmp_path / "a.log") as a, a.client() as http:
        assert "grammars" not in http.get("/stats").json()["engine"]  # nothing saved, nothing read
        first = http.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        assert http.get("/stats").json()["engine"]["grammars"] == {"entries": 1, "hits": 0, "misses": 1, "warmed": 0}
        a.signal()
        assert a.wait() == 0, a.log()
    (listed,) = ssd.glob(f"*/{grammar_list.FILE_NAME}")
    assert [c["kind"] for c in json.loads(listed.read_bytes())["constraints"]] == ["json_schema"]

    with ServeProcess(*args, log_path=tmp_path / "b.log") as b, b.client() as http:
        assert http.get("/stats").json()["engine"]["grammars"] == {"entries": 1, "hits": 0, "misses": 0, "warmed": 1}
        again = http.post("/v1/chat/completions", json=body)
        assert again.status_code == 200, again.text
        assert http.get("/stats").json()["engine"]["grammars"] == {"entries": 1, "hits": 1, "misses": 0, "warmed": 1}
    text = first.json()["choices"][0]["message"]["content"]
    assert again.json()["choices"][0]["message"]["content"] == text
    assert set(json.loads(text)) == {"city", "days"}

