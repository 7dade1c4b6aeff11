"""A next turn's fixed costs (issue 28): the conversation so far is not tokenized or decoded whole again,
the token scans run in C, and the request log says where a turn's time went, stage by stage."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
from mlx_lm.utils import load_tokenizer

from mlxd.actors.scheduler import first_token_split
from mlxd.http import stages as stages_module
from mlxd.runtime.chat.prompt_tokens import PieceEncoder
from mlxd.runtime.chat.token_history import _common_prefix, _same_text, encode_chat, render

WORDS = ["alpha", " beta", "gamma\n", "  delta", "ünï", "12", "\t", "x.y", "'s", " .", "é", "\n\n"]


@pytest.fixture()
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_common_prefix_agrees_with_a_plain_scan():
    rng = random.Random(3)
    for _ in range(500):
        n = rng.randint(0, 300)
        a = [rng.randint(0, 3) for _ in range(n)]
        b = a[: rng.randint(0, n)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 50))]
        want = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert _common_prefix(a, b) == want
        assert _common_prefix(tuple(b), a) == want  # either order, tuples and lists


def test_same_text_decodes_only_the_tail_and_agrees_with_whole_decodes(tok):
    rng = random.Random(4)
    vocab = len(tok._tokenizer)
    for _ in range(300):
        head = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        a = head + [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        b = head + [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        if rng.random() < 0.3:  # the same text spelled by other ids: a re-encoding of a's tail
            b = head + list(tok.encode(tok.decode(a[len(head):]), add_special_tokens=False))
        assert _same_text(tok, a, b) == (tok.decode(a) == tok.decode(b)), (a, b)


def conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "user", "content": "".join(rng.choice(WORDS) for _ in range(rng.randint(50, 400)))}]
    for _ in range(turns):
        msgs.append({"role": "assistant", "content": "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))})
        msgs.append({"role": "user", "content": "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))})
    return msgs


def test_a_next_turn_spliced_by_pieces_is_the_whole_encodings_splice(tok):
    """encode_chat with the runtime's piece encoder (the conversation so far reused) gives the ids the
    tokenizer's whole encoding gives, for replies whose ids are canonical and for ones that are not."""
    enc = PieceEncoder(tok, verify_first=0)
    assert enc.enabled
    rng = random.Random(6)
    eos = frozenset({tok.eos_token_id})
    for convo in range(12):
        msgs = conversation(rng, 3)
        replies: dict[str, tuple[int, ...] | None] = {}
        for m in msgs:
            if m["role"] == "assistant":
                ids = tuple(tok.encode(m["content"], add_special_tokens=False))
                if convo % 2:  # spelled one character a token where it can be: not what the tokenizer makes of it
                    spelled = [tok.encode(ch, add_special_tokens=False) for ch in m["content"]]
                    ids = tuple(t for s in spelled for t in s)
                replies[m["content"]] = ids
        rendered = render(tok, msgs, encode=enc.encode)
        assert rendered == render(tok, msgs)
        by_pieces = encode_chat(tok, msgs, replies, eos, rendered, enc.encode)
        whole = encode_chat(tok, msgs, replies, eos, rendered)
        assert by_pieces == whole, convo
        assert tok.decode(list(by_pieces[0])) == tok.decode(list(rendered[1]))


def test_a_served_turn_logs_its_stages(tiny_model_dir, monkeypatch):
    """The request log splits a streamed chat turn: the HTTP side (request.http: parse, template and tokens,
    the request built, the first token's chunk written) and the engine's part (request.done's
    first_token_ms: the hand-off, the prefix lent, the row joined, its forward steps, the delivery)."""
    from tests.serving import ServerThread, config_for

    http_lines: list[dict[str, Any]] = []

    class Recorder:
        def info(self, event: str, **fields: Any) -> None:
            if event == "request.http":
                http_lines.append(fields)

        def debug(self, event: str, **fields: Any) -> None:
            pass

    monkeypatch.setattr(stages_module, "log", Recorder())
    config = config_for(tiny_model_dir, snapshot_min_tokens=16)
    with ServerThread(config) as s:
        assert s.runtime is not None
        records: list[Any] = []
        s.runtime.scheduler.observers.append(records.append)
        messages = [{"role": "user", "content": "a long enough first message " * 12}]
        for _turn in range(2):
            body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0.0, "stream": True}
            with httpx.stream("POST", s.base_url + "/chat/completions", json=body, timeout=120) as r:
                r.raise_for_status()
                text = "".join(r.iter_text())
            assert "[DONE]" in text
            messages = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert len(records) == 2 and len(http_lines) == 2
    for record, line in zip(records, http_lines, strict=True):
        split = first_token_split(record)
        assert split is not None
        assert set(split) == {"to_engine", "lend", "join", "wait", "forward", "checkpoint", "other", "deliver",
                              "steps", "step_ms"}
        steps = split.pop("step_ms")
        assert split["steps"] >= 1 and split["forward"] > 0 and len(steps) == split["steps"]
        assert abs(sum(steps) - split["forward"]) < 0.1
        assert all(split[k] >= -0.01 for k in split)  # each a span of one clock, in order
        assert line["request_id"] == record.request_id and line["stream"] is True
        ms = line["ms"]
        order = ["parsed", "rendered", "submitted", "first_token", "first_chunk_sent"]
        assert all(k in ms for k in order)
        assert [ms[k] for k in order] == sorted(ms[k] for k in order)
    assert records[1].cached_tokens > 0  # the next turn hit the first one's checkpoint
    # request.done's leave_ms: the engine's time on each row's final checkpoint in its last step
    assert all(r.leave_s is not None and 0 < r.leave_s < 10 for r in records)


def test_realignment_is_skipped_only_where_it_cannot_change_the_ids(tok):
    """A next turn's checkpoints are prefixes of its ids: no realignment (no worker hop, no decode); a
    checkpoint that parts from them (a reply re-tokenized after a restart) still goes to best_realignment."""
    from mlxd.runtime.chat.token_history import best_realignment, needs_realignment

    text = "<|im_start|>user\nhello there, a few words<|im_end|>\n<|im_start|>assistant\nSure thing.<|im_end|>\n"
    ids = tuple(tok.encode(text, add_special_tokens=False))
    prefixes = [ids[:5], ids[:-2], ids]
    assert not needs_realignment(ids, prefixes) and not needs_realignment(ids, [])
    assert best_realignment(tok, text, ids, prefixes) == ids
    extended = ids + tuple(tok.encode(" and the reply goes on", add_special_tokens=False))  # its own end-of-turn
    assert not needs_realignment(ids, [extended]) and best_realignment(tok, text, ids, [extended]) == ids
    reply = tok.encode("Sure thing.", add_special_tokens=False)
    spelled = [t for ch in "Sure thing." for t in tok.encode(ch, add_special_tokens=False)]
    at = next(i for i in range(len(ids)) if list(ids[i:i + len(reply)]) == list(reply))
    diverging = ids[:at] + tuple(spelled) + ids[at + len(reply):]
    if diverging != ids:  # the tokenizer merges these characters: the checkpoint parts from the ids
        assert needs_realignment(ids, [*prefixes, diverging])
        assert best_realignment(tok, text, ids, [diverging]) == diverging


def test_rfind_agrees_with_mlx_lm_and_the_initial_state_too(tok):
    """The reply's initial state (a `<think>` left open by the prompt) searches the prompt in C, with the
    answer mlx-lm's Python search gives."""
    from mlxd.http.replies import initial_state, rfind

    rng = random.Random(7)
    for _ in range(400):
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(0, 40))]
        seq = [rng.randint(0, 4) for _ in range(rng.randint(1, 3))]
        assert rfind(tokens, seq) == type(tok)._find(tokens, seq, reverse=True), (tokens, seq)
    think, end = tok.encode("<think>", add_special_tokens=False), tok.encode("</think>", add_special_tokens=False)
    body = tok.encode("some words here", add_special_tokens=False)
    for prompt, want in [(body + think + body, "reasoning"), (body + think + body + end + body, "normal"),
                         (body, "normal"), (think + body + end + think, "reasoning")]:
        slow = "reasoning" if tok.rfind_think_start(list(prompt)) > tok.rfind_think_end(list(prompt)) else "normal"
        assert initial_state(tok, prompt) == want == slow


def test_a_prompt_prefilled_apart_shows_its_part_of_the_join():
    """request.done's first_token_ms: a prompt prefilled on its own before it joined has that part of `join`
    as `apart`; a row without the stage has no such key."""
    from types import SimpleNamespace

    stamps = [("joined", 1.0), ("lent", 1.001), ("prefilled_apart", 1.201), ("admitted", 1.202), ("step", 1.203),
              ("stepped", 1.213), ("first_token", 1.214)]
    record = SimpleNamespace(engine_stages=stamps, engine_sent_at=0.999, first_token_at=1.215)
    split = first_token_split(record)
    assert split is not None and split["apart"] == 200.0 and split["join"] == 201.0 and split["forward"] == 10.0
    plain = SimpleNamespace(engine_stages=[s for s in stamps if s[0] != "prefilled_apart"], engine_sent_at=0.999,
                            first_token_at=1.215)
    assert "apart" not in (first_token_split(plain) or {})
