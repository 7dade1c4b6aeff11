"""Admission by the prompt work ahead (runtime/prefill_backlog.py), on an explicit clock."""

from __future__ import annotations

from mlxd.runtime.prefill_backlog import COLD_TOKENS, MIN_SPAN_S, WINDOW_S, PrefillBacklog


def _measured(rate: float, budget_s: float = 60.0) -> PrefillBacklog:
    """A backlog that has seen `rate` prompt tokens a second over 10 busy seconds, now idle at t=10."""
    b = PrefillBacklog(budget_s)
    b.add("warm", int(rate * 10), 0.0)
    b.done("warm", 10.0)
    return b


def test_before_the_rate_is_measured_a_prompt_waits_for_one_step_of_the_others_at_most():
    b = PrefillBacklog(60.0)
    b.add("doc", 3000, 0.0)
    b.add("short", 30, 0.0)
    assert b.rate(MIN_SPAN_S / 2) == 0.0
    assert b.refusal(30, 1.0) is None  # a short prompt waits for 30 tokens of each
    why = b.refusal(3000, 1.0)  # another document would wait for all of the first one
    assert why is not None and "3030 prompt tokens are ahead" in why and "not measured" in why
    assert b.refusal(COLD_TOKENS - 30, 1.0) is None
    b.done("short", MIN_SPAN_S / 2)  # a first token, but under MIN_SPAN_S of busy time yet
    assert b.refusal(3000, MIN_SPAN_S / 2) is not None
    b.done("doc", 2 * MIN_SPAN_S)  # measured now: 3030 tokens; nothing ahead
    assert (
        b.rate(2 * MIN_SPAN_S) == 3030 / (2 * MIN_SPAN_S)
        and b.refusal(3000, 2 * MIN_SPAN_S) is None
    )


def test_the_rate_counts_only_time_with_work_waiting():
    b = _measured(100.0)
    assert b.rate(10.0) == 100.0
    assert b.rate(1000.0) == 100.0  # idle since: the busy clock stopped
    b.add("a", 500, 1000.0)
    b.done("a", 1005.0)  # 1500 tokens in 15 busy seconds
    assert b.rate(1005.0) == 100.0


def test_the_rate_is_over_the_last_window_of_busy_time():
    b = _measured(1000.0)  # 10,000 tokens in the first 10 s
    b.add("slow", 100, 10.0)
    b.done("slow", 11.0 + WINDOW_S)  # then 100 tokens in over a window: the first sample left it
    assert b.rate(11.0 + WINDOW_S) == 100 / WINDOW_S


def test_a_prompt_waits_for_at_most_its_own_length_of_each_prompt_ahead():
    b = _measured(100.0)  # 100 tokens/s
    for i in range(4):
        b.add(f"doc{i}", 3000, 10.0)
    b.add("short", 30, 10.0)
    assert b.wait_s(3000, 10.0) == (4 * 3000 + 30) / 100
    assert b.wait_s(30, 10.0) == 5 * 30 / 100  # the documents ahead hold a short prompt ~1.5 s
    why = b.refusal(3000, 10.0)
    assert why is not None and "--queue-timeout" in why and "120 s" in why
    assert b.refusal(30, 10.0) is None  # short prompts are still admitted
    assert b.refused == 1


def test_a_lone_prompt_is_never_refused_for_its_own_length():
    b = _measured(100.0, budget_s=1.0)
    assert b.refusal(1_000_000, 10.0) is None  # 10,000 s of its own prefill: nothing ahead of it


def test_cached_tokens_and_ended_requests_leave_the_backlog():
    b = _measured(100.0, budget_s=10.0)
    b.add("hit", 5000, 10.0)
    assert b.refusal(5000, 10.0) is not None
    b.accepted("hit", cached=4900)  # a cache hit: 100 tokens left to prefill
    assert b.pending_tokens == 100 and b.refusal(5000, 10.0) is None
    b.add("gone", 5000, 10.0)
    b.drop("gone", 11.0)  # cancelled before its first token: no credit to the rate
    assert b.pending_tokens == 100
    assert b.rate(11.0) == 1000 / 11


def test_a_request_whose_client_left_is_not_work_ahead():
    b = _measured(100.0, budget_s=10.0)
    alive = [True]
    b.add("waiting", 5000, 10.0, alive=lambda: alive[0])
    assert b.refusal(5000, 10.0) is not None
    alive[0] = False  # its HTTP handler answered 503 (--queue-timeout); still in the queue
    assert b.refusal(5000, 10.0) is None


def test_a_zero_budget_refuses_nothing():
    b = _measured(1.0, budget_s=0.0)
    b.add("huge", 10**9, 10.0)
    assert b.refusal(10**9, 20.0) is None
