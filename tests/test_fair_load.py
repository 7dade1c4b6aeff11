"""Fair under load: prompts are measured and admitted before they are tokenized, tokenizing never
blocks the event loop, and many mixed streaming clients all get an answer (2xx or a clean 503)."""

from __future__ import annotations

import http.client
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.serving import ServerThread, config_for

from mlxd.engine.core import EngineCore
from mlxd.engine.ops import RowStart, StepOps
from mlxd.engine.prefill_slices import APART_MIN, MIN_CHUNK, PrefillSlicer, aligned
from mlxd.model import build_model
from mlxd.runtime.chat.prompt_bound import PromptBound, chat_chars
from mlxd.runtime.kernel.messages import (
    GenerationFinished,
    GenerationRequest,
    PrefillMeasured,
    PublishPrefix,
    SamplingParams,
    TokenGenerated,
)
from mlxd.runtime.supervisor import QueueFull

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from load_test import stream_chat  # noqa: E402

CONTEXT = (
    60_000  # long enough that a 200k-character prompt passes the character bound and is tokenized
)
NO_EOS = {"0": -100, "2": -100}
BOUND_S = 120.0  # generous: only bounds a failure
TURNS = 1


@pytest.fixture(scope="module")
def one_slot(tiny_model_dir):
    """One batch slot and no queue: a second request while one generates is refused."""
    config = config_for(
        tiny_model_dir, max_context=CONTEXT, max_batch=1, prefill_batch=1, max_queue=0
    )
    with ServerThread(config) as server:
        yield server


def _root(server: ServerThread) -> str:
    return server.base_url.removesuffix("/v1")


def _words(chars: int) -> str:
    text = "hello world, this is a test of many words. " * (chars // 40 + 1)
    return text[:chars]


def test_the_character_bound_never_exceeds_the_real_token_count(tiny_model):
    _, tokenizer = tiny_model
    bound = PromptBound.of(tokenizer)
    assert bound.chars_per_token > 0
    samples = [
        _words(5000),
        "ünïcödé ✓ 漢字 " * 200,
        "<|im_start|>" * 100,
        "a" * 3000,
        " " * 2000,
        "0123456789" * 300,
    ]
    for text in samples:
        assert bound.fewest_tokens(len(text)) <= len(tokenizer.encode(text)), text[:30]


def test_chat_chars_counts_what_every_template_copies():
    messages = [
        {"role": "system", "content": " be brief "},
        {
            "role": "user",
            "content": [{"type": "text", "text": "abc"}, {"type": "image_url", "image_url": {}}],
        },
        {"role": "assistant", "content": "<think>long</think>dropped by some templates"},
        {"role": "tool", "content": "xy"},
    ]
    assert chat_chars(messages) == len("be brief") + 3 + 2


def test_a_14_mib_prompt_is_refused_from_its_characters(one_slot):
    prompt = _words(14 * 1024 * 1024)
    r = httpx.post(
        _root(one_slot) + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 4},
        timeout=BOUND_S,
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "characters, so at least" in error["message"]  # refused before tokenization, not after


def test_a_chat_too_long_by_its_characters_is_refused_untokenized(one_slot):
    messages = [{"role": "user", "content": _words(7_000_000)}]
    r = httpx.post(
        one_slot.base_url + "/chat/completions",
        json={"messages": messages, "max_tokens": 4},
        timeout=BOUND_S,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages" and "characters" in r.json()["error"]["message"]


def test_health_answers_while_a_long_prompt_is_tokenized(one_slot, monkeypatch):
    url, rt = _root(one_slot), one_slot.runtime
    tokenizing, tokenized = threading.Event(), threading.Event()
    encode = rt.encode

    def watched_encode(text: str) -> tuple[int, ...]:  # the real encode, telling when it runs
        tokenizing.set()
        try:
            return encode(text)
        finally:
            tokenized.set()

    monkeypatch.setattr(rt, "encode", watched_encode)
    big: dict[str, httpx.Response] = {}

    def send_big() -> None:
        big["r"] = httpx.post(
            url + "/v1/completions",
            json={"prompt": _words(400_000), "max_tokens": 4},
            timeout=BOUND_S,
        )

    thread = threading.Thread(target=send_big)
    thread.start()
    assert tokenizing.wait(BOUND_S)
    during = 0  # /health answers given while the prompt was being tokenized
    with httpx.Client(timeout=BOUND_S) as client:
        while not tokenized.is_set():
            if client.get(url + "/health").status_code == 200 and not tokenized.is_set():
                during += 1
    thread.join()
    # The prompt passes the character bound, is tokenized (off the event loop), then is too long.
    r = big["r"]
    assert r.status_code == 400 and "tokens) + max_tokens" in r.json()["error"]["message"], r.text[
        :300
    ]
    assert during >= 1  # with tokenization on the event loop, /health waits for all of it


def test_a_full_queue_refuses_before_tokenizing(one_slot):
    url = _root(one_slot)
    busy = {
        "prompt": "keep the only slot busy",
        "max_tokens": 3000,
        "stream": True,
        "logit_bias": NO_EOS,
    }
    before = httpx.get(url + "/stats", timeout=BOUND_S).json()
    with (
        httpx.Client(timeout=BOUND_S) as client,
        client.stream("POST", url + "/v1/completions", json=busy) as s,
    ):
        assert s.status_code == 200
        lines = s.iter_lines()
        assert next(
            line for line in lines if line.startswith("data: ")
        )  # generating: the slot is taken
        # Too long once tokenized (a 400 after tokenizing), but the queue is full: a 503 first.
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": _words(400_000), "max_tokens": 4},
            timeout=BOUND_S,
        )
        assert r.status_code == 503, r.text[:300]
        assert r.json()["error"]["type"] == "server_overloaded" and r.headers["retry-after"] == "1"
        chat = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            timeout=BOUND_S,
        )
        assert chat.status_code == 503
    after = httpx.get(url + "/stats", timeout=BOUND_S).json()
    assert after["scheduler"]["rejected"] >= before["scheduler"]["rejected"] + 2


# --- many mixed streaming clients ------------------------------------------------------------


@pytest.fixture(scope="module")
def small_server(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, max_batch=4, max_queue=4)) as server:
        yield server


@pytest.fixture(scope="module")
def default_server(tiny_model_dir):
    """Every serving flag at its default (max_batch 8, max_queue 32, --queue-timeout 60, no TTFT limit)."""
    with ServerThread(config_for(tiny_model_dir)) as server:
        yield server


def _mixed_clients(server: ServerThread, clients: int) -> list:
    """`clients` streaming clients at once, one in four with a long prompt; each one's outcomes."""
    outcomes: list = []
    lock = threading.Lock()

    def client(i: int) -> None:
        long_prompt = i % 4 == 0
        words = " ".join(f"word{j % 97}" for j in range(300 if long_prompt else 8))
        with httpx.Client(base_url=_root(server), timeout=BOUND_S) as http:
            for turn in range(TURNS):
                messages = [{"role": "user", "content": f"client {i} turn {turn}: {words}"}]
                outcome, _ = stream_chat(http, messages, 4)
                with lock:
                    outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * BOUND_S)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert len(outcomes) == clients * TURNS
    kinds = {o.kind for o in outcomes}
    # A read that waits BOUND_S for a byte is "broken" (httpx.ReadTimeout): a hang fails here too.
    assert kinds <= {"ok", "refused"}, [
        (o.kind, o.status, o.detail) for o in outcomes if o.kind not in ("ok", "refused")
    ]
    assert {o.status for o in outcomes if o.kind == "refused"} <= {503}
    return outcomes


def test_32_mixed_streaming_clients_all_answered(small_server):
    """Short and long prompts together: every request ends with [DONE] or a clean 503, none hangs."""
    outcomes = _mixed_clients(small_server, 32)
    # 4 slots and 4 places in the queue: at least the first 8 are served (none waits 60 s here).
    assert sum(o.kind == "ok" for o in outcomes) >= 8


def test_32_mixed_streaming_clients_with_default_flags_all_answered(default_server):
    """The same with every flag at its default: answered ([DONE] or a clean 503), none hangs."""
    outcomes = _mixed_clients(default_server, 32)
    assert sum(o.kind == "ok" for o in outcomes) >= 1  # the first one finds nothing ahead of it


def test_an_idle_connection_outlives_a_pooled_clients_own_expiry(default_server):
    """httpx drops a pooled connection idle for 5 s; the server must not close it first (at the same
    5 s, a request sent as the server closed came back "Server disconnected" under load)."""
    idle = httpx.Limits().keepalive_expiry
    assert idle is not None and default_server.config.keep_alive_timeout_s >= 2 * idle
    conn = http.client.HTTPConnection(
        *_root(default_server).removeprefix("http://").split(":"), timeout=BOUND_S
    )
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None  # kept alive
        time.sleep(idle + 1)  # past the client's own expiry: it would have closed by now
        conn.request("GET", "/health")  # the same socket, still open at the server
        assert conn.getresponse().status == 200
    finally:
        conn.close()


# --- admission by the prompt work ahead ----------------------------------------------------------


@pytest.fixture(scope="module")
def backlog_server(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, queue_timeout_s=5.0)) as server:
        yield server


def test_a_long_prompt_behind_too_much_prompt_work_is_refused_at_once(backlog_server):
    """Past --queue-timeout of prompt work ahead (at the measured rate), a long prompt gets a 503
    before it queues; a short one, which waits only for its own length of each, is served."""
    server, url = backlog_server, _root(backlog_server)

    async def seed() -> None:  # 100 prompt tokens/s measured, then 100,000 tokens ahead
        backlog, now = server.runtime.scheduler.backlog, time.monotonic()
        backlog.add("measured", 1000, now - 10.0)
        backlog.done("measured", now)
        backlog.add("ahead", 100_000, now)

    async def clear() -> None:
        server.runtime.scheduler.backlog.drop("ahead", time.monotonic())

    server.call(seed)
    try:
        long_body = {"prompt": [20 + i % 900 for i in range(2000)], "max_tokens": 2}  # 20 s ahead
        r = httpx.post(url + "/v1/completions", json=long_body, timeout=BOUND_S)
        assert r.status_code == 503, r.text[:300]
        error = r.json()["error"]
        assert error["type"] == "server_overloaded" and r.headers["retry-after"] == "1"
        assert "prompts ahead" in error["message"] and "--queue-timeout" in error["message"]
        short = {"prompt": [30] * 20, "max_tokens": 2}  # 0.2 s of each prompt ahead
        assert httpx.post(url + "/v1/completions", json=short, timeout=BOUND_S).status_code == 200

        async def further_choice() -> list[int]:  # n > 1: its prompt is cached by the first choice
            rt, sampling = (
                server.runtime,
                SamplingParams(max_tokens=2, logit_bias=((0, -100.0), (2, -100.0))),
            )
            with pytest.raises(QueueFull):  # as a request of its own, refused
                rt.submit(rt.request(long_body["prompt"], sampling=sampling), within_queue_timeout=True)
            embedded = rt.request(long_body["prompt"], sampling=sampling)
            assert len(await rt.submit(embedded).tokens()) == 2, "an embedder's request waits its turn"
            request = rt.request(long_body["prompt"], sampling=sampling)
            return await rt.submit(request, follows=True, within_queue_timeout=True).tokens()  # not refused

        assert len(server.call(further_choice)) == 2
    finally:
        server.call(clear)
    r = httpx.post(url + "/v1/completions", json=long_body, timeout=BOUND_S)
    assert r.status_code == 200, r.text[:300]  # nothing ahead: served


# --- long prefills in slices ------------------------------------------------------------------


def test_slices_follow_the_measured_rate_in_powers_of_two():
    slicer = PrefillSlicer(0.05)
    assert (
        slicer.chunk(2048, newcomers=[], shared=False) == 2048
    )  # nothing measured yet: whole steps
    slicer.measured(2048, 1.0)  # 2048 tokens/s: 102 tokens in 50 ms
    assert slicer.chunk(2048, newcomers=[], shared=False) == 64
    assert (
        slicer.chunk(2048, newcomers=[20], shared=True) == 32
    )  # newcomers finish their prompt this step
    assert slicer.chunk(2048, newcomers=[3], shared=True) == MIN_CHUNK
    assert slicer.chunk(2048, newcomers=[500], shared=True) == 64  # still one slice
    assert slicer.chunk(8, newcomers=[], shared=False) == 8  # never past the step size
    # A row waits for its first token: the others' steps stay as short as a decode step.
    assert slicer.chunk(2048, newcomers=[], shared=True, awaiting=True) == 1
    assert (
        slicer.chunk(2048, newcomers=[], shared=False, awaiting=True) == 64
    )  # alone: its own slice
    assert PrefillSlicer(0.0, rate=2048.0).chunk(2048, newcomers=[20], shared=True) == 2048  # off
    # A short prompt joining while another row is part way through its prompt is prefilled on its own.
    assert slicer.apart(APART_MIN, others_prefilling=True)
    assert slicer.apart(400, others_prefilling=True)  # 4 slices of 102 tokens
    assert not slicer.apart(500, others_prefilling=True)
    assert not slicer.apart(20, others_prefilling=False)
    assert not PrefillSlicer(0.05).apart(20, others_prefilling=True)  # no rate measured yet
    # A prompt joining an empty batch is prefilled on its own, a slice a step, when it has a whole step or more
    # (a shorter one, a next turn's suffix, keeps the batch); with slices off, never.
    assert slicer.alone(256, 256) and slicer.alone(5000, 256)
    assert not slicer.alone(255, 256)
    assert PrefillSlicer(0.05).alone(300, 128)  # nothing measured yet: whole steps, apart all the same
    assert not PrefillSlicer(0.0, rate=2048.0).alone(300, 128)


def test_an_aligned_chunk_ends_on_a_multiple_of_its_size_unless_the_prompt_ends_first():
    assert aligned(2048, 0, 16_000) == 2048
    assert aligned(2048, 3, 16_000) == 2045  # after a 3-token cached prefix: to 2048, then whole chunks
    assert aligned(2048, 4096, 16_000) == 2048
    assert aligned(4096, 2048, 16_000) == 2048  # a chunk grown part way: to 4096, not 6144
    assert aligned(2048, 2047, 16_000) == 1
    assert aligned(2048, 16_400, 30) == 30  # a last chunk is not cut: its key length is new wherever it starts
    assert aligned(2048, 3, 2048) == 2048 and aligned(2048, 3, 2049) == 2045  # fits one chunk: whole
    assert aligned(1, 12_345, 900) == 1  # the steps that hold a waiting row's first token stay one token


def test_a_fit_is_kept_until_a_chunk_is_measured_and_agrees_with_a_fresh_one():
    """Each prefilling step asks for its chunk; the fit over the recent chunks (pairwise slopes) is made
    again only after a new measurement, or a rate or slice set by hand, and is what a slicer fed the
    same chunks from scratch says."""
    sizes = (2048, 64, 512, 128, 1024, 256, 16, 700, 90)
    slicer = PrefillSlicer(0.05)
    for i, size in enumerate(sizes):
        slicer.measured(size, 0.030 + 2e-5 * size * (1 + i % 3))
        fresh = PrefillSlicer(0.05)
        for j, again in enumerate(sizes[: i + 1]):
            fresh.measured(again, 0.030 + 2e-5 * again * (1 + j % 3))
        for step_size in (2048, 256, 2048):
            assert slicer.chunk(step_size, newcomers=[], shared=False) == fresh.chunk(step_size, newcomers=[],
                                                                                      shared=False), (i, step_size)
    kept = slicer.chunk(2048, newcomers=[], shared=False)
    slicer.slice_s = 0.2  # a longer slice: larger chunks, not the kept fit
    assert slicer.chunk(2048, newcomers=[], shared=False) > kept
    slicer.slice_s = 0.05
    assert slicer.chunk(2048, newcomers=[], shared=False) == kept
    slicer.measured(2048, 5.0)  # a slow whole chunk: a new fit
    fresh.measured(2048, 5.0)
    assert slicer.chunk(2048, newcomers=[], shared=False) == fresh.chunk(2048, newcomers=[], shared=False)


def test_a_fixed_step_cost_near_the_slice_does_not_shrink_chunks_to_the_minimum():
    """Each step costs a fixed 60 ms plus 10 µs a token (an H200 serving a 1.7B model): sized by the
    whole rate, the chunks fell to MIN_CHUNK and a 16k prompt took ~800 steps; the fitted per-token
    cost keeps them near the step size."""
    slicer = PrefillSlicer(0.05)
    sizes, done = [], 0
    while done < 16_384:
        size = slicer.chunk(2048, newcomers=[], shared=True) if done else 2048
        slicer.measured(size, 0.060 + 1e-5 * size)
        sizes.append(size)
        done += size
    assert min(sizes) >= 1024 and len(sizes) <= 12, sizes
    # Where the work per token is what costs (a CPU), chunks still come out at about one slice.
    cpu = PrefillSlicer(0.05)
    for size in (2048, 64, 64):
        cpu.measured(size, 0.002 + size / 2048)
    assert cpu.chunk(2048, newcomers=[], shared=False) == 64


def test_a_first_chunk_slowed_by_a_compile_does_not_pin_chunks_at_the_minimum():
    """A server's first prefill (a 91-token warm-up) took 360 ms, most of it compiling kernels: its
    rate asked for MIN_CHUNK, every later chunk was MIN_CHUNK, no second size came for the fit, and
    a 16k prompt took ~1,000 steps (65 s on the H200). The slicer tries another size instead."""
    slicer = PrefillSlicer(0.05)
    slicer.measured(91, 0.360)
    sizes, done = [], 0
    while done < 16_384:
        size = slicer.chunk(2048, newcomers=[], shared=True)
        slicer.measured(size, 0.060 + 1e-5 * size)
        sizes.append(size)
        done += size
    assert len(sizes) <= 30 and max(sizes) >= 1024, sizes
    # A stream of one size alone (every chunk MIN_CHUNK) gets a second size on the next chunk.
    stuck = PrefillSlicer(0.05)
    for _ in range(8):
        stuck.measured(16, 0.062)
    assert stuck.chunk(2048, newcomers=[], shared=True) == 32
    # At the step size no other size is tried: the whole rate errs small, so no fit could ask for less (a CPU
    # whose whole chunks take a slice), and more is not allowed.
    whole = PrefillSlicer(0.05)
    whole.measured(2048, 0.05)
    assert whole.chunk(2048, newcomers=[], shared=False) == 2048
    assert whole.chunk(3000, newcomers=[], shared=False) == 2048  # (the largest power of two within the step)


def test_a_process_first_long_prompt_goes_in_whole_steps_where_one_step_fits_a_slice():
    """An H100 (4 ms a step + 7.8 µs a token, a 2,048-token chunk in 20 ms, the slice 50 ms): the first long
    prompt of a process, nothing measured before it, went 2,048, 1,024, 1,024, then 2,048s, the second size
    tried for the fit; on CUDA each new (queries, keys) shape builds an attention graph the warm-up (whole
    steps from 0) did not, and the first returning turn after a restart took 0.16 s more than the next. Now
    every chunk is the step size, as the warm-up's were, and stays so as the context grows."""
    slicer, sizes, at = PrefillSlicer(0.05), [], 0
    while at < 16_384:
        size = aligned(slicer.chunk(2048, newcomers=[], shared=False), at, 16_384 - at)
        slicer.measured(size, 0.004 + 7.8e-6 * size + 1e-10 * size * at)  # (attention over the context)
        sizes.append(size)
        at += size
    assert sizes == [2048] * 8, sizes


def test_one_slow_chunk_does_not_shrink_the_next_prompts_chunks():
    """The H200 run of 15:54 (sim_ttft-h200-20261204-155620.json): a 1,024-token miss in one chunk
    (75 ms), then a RAM hit's 127-token chunk slowed by its first compile (150 ms): sized by that last
    rate, the next miss went in 32-token chunks (1.16 s, both runs). Bounded by the fastest chunk's
    whole rate it goes in 512s; so does a slow chunk among measured ones (median pairwise slope)."""
    slicer = PrefillSlicer(0.05)
    slicer.measured(1023, 0.075)
    slicer.measured(127, 0.150)
    assert slicer.chunk(2048, newcomers=[], shared=False) >= 512
    steady = PrefillSlicer(0.05)  # 40 ms a step + 4 µs a token, then one chunk 25x slower (a compile)
    for size in (512, 1024, 256, 512, 1024, 256):
        steady.measured(size, 0.040 + 4e-6 * size)
    steady.measured(256, 1.0)
    assert steady.chunk(2048, newcomers=[], shared=False) == 2048
    assert steady.apart(400, others_prefilling=True)  # the fastest rate, not the slow chunk's
    # Where the work per token is what costs (a CPU at 2,048 tokens/s), chunks stay one slice.
    cpu = PrefillSlicer(0.05)
    for size in (64, 128, 64, 128):
        cpu.measured(size, 0.002 + size / 2048)
    assert cpu.chunk(2048, newcomers=[], shared=False) == 64


def test_a_run_of_short_turns_does_not_cut_the_next_long_prompt_short():
    """Each wave of the H200 run began with misses of 0.25-0.9 s after a round of 127-token turns: those
    chunks are nearly all fixed cost (~40 ms), and alone they ask for 128-token chunks, 8 steps for a
    1,024-token miss where 1 does. The latest chunk of another size class (the last miss's) still counts;
    a stale slow one cannot pin the chunks small (only a larger size is taken from older chunks)."""
    slicer = PrefillSlicer(0.05)
    slicer.measured(1023, 0.045)
    for _ in range(12):
        slicer.measured(127, 0.040)
    assert slicer.chunk(2048, newcomers=[], shared=False) >= 1024
    stale = PrefillSlicer(0.05)  # a 1,023-token chunk slowed by a compile, then 127-token turns
    stale.measured(1023, 1.2)
    for _ in range(12):
        stale.measured(127, 0.040)
    assert stale.chunk(2048, newcomers=[], shared=False) == 256  # the recent chunks' next size, not the stale one's
    # Sizes one token apart give no slope (noise over one token): 128-token chunks and a 127-token tail.
    near = PrefillSlicer(0.05)
    for size, seconds in ((128, 0.040), (127, 0.046), (128, 0.041), (127, 0.039)):
        near.measured(size, seconds)
    assert near.chunk(2048, newcomers=[], shared=False) == 256  # another size for the fit, not 16


def test_a_pathological_timing_never_makes_a_chunk_of_0_or_past_the_step_size():
    """Timings no clock should give (0, negative, sub-nanosecond, infinite, NaN) are ignored: 5e-324 s
    divided the slice by a per-token cost of 0.0 (ZeroDivisionError in the engine's step) and an
    infinite one made the fit's sizes inf (OverflowError); one huge chunk is bounded by the step size."""
    for bad in (0.0, -1.0, 5e-324, 1e-300, float("inf"), float("nan")):
        slicer = PrefillSlicer(0.05)
        slicer.measured(16, 0.6)
        slicer.measured(127, bad)
        slicer.measured(1, bad)
        for newcomers, shared in (([], False), ([5], True), ([0], True)):
            size = slicer.chunk(2048, newcomers=newcomers, shared=shared)
            assert MIN_CHUNK <= size <= 2048, (bad, size)
    huge = PrefillSlicer(0.05)
    huge.measured(10_000_000, 0.001)
    assert huge.chunk(2048, newcomers=[], shared=False) == 2048
    assert huge.chunk(8, newcomers=[], shared=False) == 8


def _first_tokens(core: EngineCore, long: RowStart, short: RowStart) -> list[str]:
    """Which request got its first token first: the long prompt joins, one step later the short one."""
    order: list[str] = []
    ops = [StepOps(starts=(long,)), StepOps(starts=(short,))]
    for step in range(2000):
        result = core.step(ops[step] if step < len(ops) else StepOps())
        for e in result.emits:
            if isinstance(e.event, TokenGenerated) and e.request_id not in order:
                order.append(e.request_id)
        if len(order) == 2:
            return order
    raise AssertionError("no first tokens")


def _row(rid: str, prompt: list[int]) -> RowStart:
    return RowStart(
        request=GenerationRequest(
            request_id=rid, prompt=tuple(prompt), sampling=SamplingParams(max_tokens=2)
        )
    )


@pytest.mark.parametrize("slice_s", [1e-6, 0.0])
def test_a_short_prompt_gets_its_first_token_while_a_long_one_prefills(tiny_model_dir, slice_s):
    """With slices, the short prompt answers before the long one; in whole steps, after it."""
    config = config_for(
        tiny_model_dir, prompt_cache_bytes=0, prefill_slice_s=slice_s, max_context=8192
    )
    core = EngineCore(config)
    core.load()
    try:
        core.step(
            StepOps(starts=(_row("warm", list(range(20, 120))),))
        )  # measures the prefill rate
        while core.step(StepOps()).stats.batch_rows:
            pass
        order = _first_tokens(
            core, _row("long", [20 + i % 900 for i in range(1500)]), _row("short", [30] * 20)
        )
    finally:
        core.close()
    assert order == (["short", "long"] if slice_s else ["long", "short"])


# --- a bounded wait in the queue -------------------------------------------------------------


@pytest.fixture(scope="module")
def queue_of_two(tiny_model_dir):
    config = config_for(
        tiny_model_dir,
        max_batch=1,
        prefill_batch=1,
        max_queue=2,
        queue_timeout_s=0.5,
        max_context=60_000,
        max_tokens_limit=60_000,
    )
    with ServerThread(config) as server:
        yield server


def test_a_request_that_waits_too_long_for_a_slot_gets_a_503(queue_of_two):
    url = _root(queue_of_two)
    busy = {
        "prompt": "keep the only slot busy",
        "max_tokens": 50_000,
        "stream": True,
        "logit_bias": NO_EOS,
    }
    with (
        httpx.Client(timeout=BOUND_S) as client,
        client.stream("POST", url + "/v1/completions", json=busy) as s,
    ):
        assert s.status_code == 200
        lines = s.iter_lines()  # held: a dropped iterator would close the stream and free the slot
        assert next(line for line in lines if line.startswith("data: "))  # the slot is taken
        for stream in (False, True):  # queued, then refused: a stream gets its 503 before any event
            r = httpx.post(
                url + "/v1/completions",
                json={"prompt": "wait", "max_tokens": 2, "stream": stream},
                timeout=BOUND_S,
            )
            assert r.status_code == 503, r.text[:300]
            assert r.json()["error"]["type"] == "server_overloaded" and "--queue-timeout" in r.text
    # Once the busy client's generation is cancelled, the slot is free again: served.
    statuses = []
    while not statuses or statuses[-1] == 503 and len(statuses) < 100:
        r = httpx.post(
            url + "/v1/completions", json={"prompt": "now", "max_tokens": 2}, timeout=BOUND_S
        )
        statuses.append(r.status_code)
    assert statuses[-1] == 200, statuses


def _tokens(results_by_step: list, rid: str) -> list[int]:
    return [
        e.event.token
        for r in results_by_step
        for e in r.emits
        if e.request_id == rid and isinstance(e.event, TokenGenerated)
    ]


def test_a_short_prompt_prefilled_apart_answers_as_it_does_alone(tiny_model_dir):
    """Behind a long prefill the short prompt is prefilled on its own: the same greedy tokens as alone."""
    config = config_for(
        tiny_model_dir, prefill_slice_s=1e-6, max_context=8192, snapshot_min_tokens=4
    )
    core = EngineCore(config)
    core.load()
    short = [40 + i % 50 for i in range(12)]  # within MIN_CHUNK: prefilled apart at any slice

    def until_done(first: StepOps) -> list:
        results = [core.step(first)]
        while results[-1].stats.batch_rows:
            results.append(core.step(StepOps()))
        return results

    def row(rid: str, prompt: list[int], n: int) -> RowStart:
        sampling = SamplingParams(max_tokens=n, logit_bias=((0, -100.0), (2, -100.0)))
        return RowStart(
            request=GenerationRequest(request_id=rid, prompt=tuple(prompt), sampling=sampling)
        )

    try:
        alone = _tokens(until_done(StepOps(starts=(row("alone", short, 8),))), "alone")
        results = [
            core.step(StepOps(starts=(row("long", [20 + i % 900 for i in range(1500)], 2),)))
        ]
        results += until_done(StepOps(starts=(row("short", short, 8),)))
    finally:
        core.close()
    assert len(alone) == 8 and _tokens(results, "short") == alone
    # Its prompt-boundary checkpoint is published as a batch prefill would have published it.
    boundaries = [
        n.tokens
        for r in results
        for n in r.notes
        if isinstance(n, PublishPrefix) and n.reason == "boundary"
    ]
    assert tuple(short[:-1]) in boundaries
    assert core.counters.checkpoints_skipped == 0


def test_short_prompts_starting_together_share_the_batch_and_behind_a_long_one_go_apart(tiny_model_dir):
    """Eight requests at once: a short prompt joining rows whose prompts are short too shares their forward (apart,
    each would run a forward of its own, one after another); behind a long prefill it is still prefilled apart."""
    core = EngineCore(config_for(tiny_model_dir, prefill_slice_s=1e-6, max_context=8192))
    core.load()

    def row(rid: str, prompt: list[int]) -> RowStart:
        sampling = SamplingParams(max_tokens=3, logit_bias=((0, -100.0), (2, -100.0)))
        return RowStart(request=GenerationRequest(request_id=rid, prompt=tuple(prompt), sampling=sampling))

    def served(first: StepOps) -> dict[str, tuple[int, set[str]]]:
        """Per request: its tokens and the names of its stages to its first token."""
        out: dict[str, tuple[int, set[str]]] = {}
        result = core.step(first)
        while True:
            for e in result.emits:
                if isinstance(e.event, TokenGenerated):
                    n, stages = out.get(e.request_id, (0, set()))
                    out[e.request_id] = (n + 1, stages | {name for name, _ in e.event.stages})
            if not result.stats.batch_rows:
                return out
            result = core.step(StepOps())

    try:
        served(StepOps(starts=(row("warm", [40 + i % 50 for i in range(30)]),)))  # the slicer has a rate
        assert core._slicer.apart(30, others_prefilling=True)  # (so only the rows beside it decide)
        shorts = [row(f"s{j}", [30 + (i * (j + 3)) % 700 for i in range(30)]) for j in range(4)]
        together = served(StepOps(starts=tuple(shorts)))
        behind = served(StepOps(starts=(row("long", [20 + i % 900 for i in range(1500)]),
                                        row("short", [40 + i % 50 for i in range(30)]))))
    finally:
        core.close()
    assert all(n == 3 and "prefilled_apart" not in stages for n, stages in together.values())
    assert behind["short"][0] == 3 and "prefilled_apart" in behind["short"][1]


def test_no_first_token_within_the_ttft_timeout_is_a_503_even_for_a_stream(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, ttft_timeout_s=1e-4)) as server:
        url = _root(server)
        for stream in (
            False,
            True,
        ):  # a stream's headers wait for its first token: a real 503 status
            r = httpx.post(
                url + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 2, "stream": stream},
                timeout=BOUND_S,
            )
            assert r.status_code == 503, r.text[:300]
            assert "--ttft-timeout" in r.json()["error"]["message"]


# (preset, KV bits): plain attention, sliding window, hybrid, pure recurrent, quantized KV8
KINDS = [("test", None), ("test-gemma3", None), ("test-qwen3next", None), ("test-mamba2", None), ("test-wide", 8)]


@pytest.fixture(scope="module")
def kind_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    return {name: build_model(root / name, name, seed=0) for name in dict(KINDS)}


@pytest.mark.parametrize(("preset", "kv_bits"), KINDS)
def test_a_long_prompt_alone_is_prefilled_apart_and_answers_as_the_batch_does(kind_dirs, preset, kv_bits):
    """A prompt of a whole step or more joining an empty batch is prefilled on its own caches, chunk by timed
    chunk (the slicer and the restore advisor see them), and decodes what the batch path decodes, on every
    cache kind."""
    long = [20 + (i * 7) % 900 for i in range(300)]

    def served(slice_s: float) -> tuple[list[int], list, list]:
        config = config_for(kind_dirs[preset], prefill_slice_s=slice_s, prefill_step_size=64, max_context=8192,
                            snapshot_min_tokens=4, kv_bits=kv_bits)
        core = EngineCore(config)
        core.load()
        sampling = SamplingParams(max_tokens=6, logit_bias=((0, -100.0), (1, -100.0), (2, -100.0)))
        try:
            warm = StepOps(starts=(RowStart(request=GenerationRequest(
                request_id="warm", prompt=tuple(range(30, 60)), sampling=sampling)),))
            results = [core.step(warm)]
            while results[-1].stats.batch_rows:
                results.append(core.step(StepOps()))
            results = [core.step(StepOps(starts=(RowStart(request=GenerationRequest(
                request_id="long", prompt=tuple(long), sampling=sampling)),)))]
            while results[-1].stats.batch_rows:
                results.append(core.step(StepOps()))
        finally:
            core.close()
        firsts = [e.event for r in results for e in r.emits
                  if e.request_id == "long" and isinstance(e.event, TokenGenerated) and e.event.stages]
        measured = [n for r in results for n in r.notes if isinstance(n, PrefillMeasured) and not n.whole]
        return _tokens(results, "long"), [s for s, _ in firsts[0].stages], measured

    apart, apart_stages, apart_chunks = served(100.0)  # slices longer than any step here: chunks of the step
    batch, batch_stages, _ = served(0.0)  # no slices: every prompt through mlx-lm's batch
    assert len(batch) == 6 and apart == batch
    assert "prefilled_apart" in apart_stages and "prefilled_apart" not in batch_stages
    # Chunks of the step size, aligned, each timed from where it starts; the last token is the batch's.
    assert [(n.new_tokens, n.context) for n in apart_chunks] == [(64, 0), (64, 64), (64, 128), (64, 192), (43, 256)]


def _lone_core(tiny_model_dir) -> EngineCore:
    """A core that takes a 300-token prompt alone apart in 64-token chunks, one a step (slices longer than any
    step here: the chunk is the step size whatever this machine's speed)."""
    core = EngineCore(config_for(tiny_model_dir, prefill_step_size=64, prefill_slice_s=100.0, max_context=8192,
                                 snapshot_min_tokens=4))
    core.load()
    return core


LONE = [20 + (i * 7) % 900 for i in range(300)]


def test_a_request_arriving_while_a_lone_prompt_prefills_apart_joins_at_the_next_step(tiny_model_dir):
    """The lone prompt goes a chunk a step: a short prompt sent after its first chunk gets its first token
    before the long one, and both decode what they decode alone."""
    core = _lone_core(tiny_model_dir)
    short = [40 + i % 50 for i in range(12)]
    try:
        alone_short = _tokens(_until_idle(core, StepOps(starts=(_row("s0", short),))), "s0")
        alone_long = _tokens(_until_idle(core, StepOps(starts=(_row("l0", LONE),))), "l0")
        first = core.step(StepOps(starts=(_row("long", LONE),)))
        assert first.stats.batch_rows == 1 and not first.emits  # one chunk done, not in the batch yet
        results = [first, *_until_idle(core, StepOps(starts=(_row("short", short),)))]
    finally:
        core.close()
    order = [e.request_id for r in results for e in r.emits if isinstance(e.event, TokenGenerated)]
    assert order.index("short") < order.index("long")
    # the short one was prefilled apart at once, and no chunk of the long one ran until its first token was out
    short_first = next(i for i, r in enumerate(results) for e in r.emits
                       if e.request_id == "short" and isinstance(e.event, TokenGenerated))
    chunks_before = [n for r in results[1:short_first] for n in r.notes  # (the long one's are 64 tokens)
                     if isinstance(n, PrefillMeasured) and n.new_tokens == 64]
    assert short_first <= 3 and not chunks_before
    assert _tokens(results, "short") == alone_short and _tokens(results, "long") == alone_long
    # the long prompt's chunks beside the short row were not timed (its decode's work was in flight)
    timed = [n.context for r in results for n in r.notes if isinstance(n, PrefillMeasured) and not n.whole]
    assert 0 in timed and 64 not in timed


def test_a_fresh_engines_first_long_prompt_goes_in_chunks_of_the_step(tiny_model_dir):
    """Nothing measured before it: its first chunk's rate already asks for a whole step (slices longer than any
    step here), so no other size is tried for the fit; every chunk but the last is the step size from 0, the
    shapes a warm-up of whole steps built (it went 64, 32, 32, 64, ...: on CUDA two shapes built on a request)."""
    core = _lone_core(tiny_model_dir)
    try:
        results = _until_idle(core, StepOps(starts=(_row("long", LONE),)))
    finally:
        core.close()
    chunks = [(n.new_tokens, n.context) for r in results for n in r.notes
              if isinstance(n, PrefillMeasured) and not n.whole]
    assert chunks == [(64, 0), (64, 64), (64, 128), (64, 192), (43, 256)]


def test_a_lone_prompt_cancelled_while_it_prefills_apart_ends_at_once(tiny_model_dir):
    core = _lone_core(tiny_model_dir)
    try:
        first = core.step(StepOps(starts=(_row("long", LONE),)))
        assert first.stats.batch_rows == 1 and first.stats.steps == 1  # a step of the apart prefill is a step
        again = core.step(StepOps(starts=(_row("long", LONE),)))  # the same id while it prefills: refused
        assert [r.request_id for r in again.rejected] == ["long"]
        ended = core.step(StepOps(cancels=("long",)))
        assert ended.stats.batch_rows == 0 and ended.finished == ("long",)
        (finish,) = [e.event for e in ended.emits]
        assert isinstance(finish, GenerationFinished) and finish.reason == "cancelled" and finish.completion_tokens == 0
        after = _tokens(_until_idle(core, StepOps(starts=(_row("next", [5, 6, 7, 8]),))), "next")
    finally:
        core.close()
    assert len(after) == 2  # the engine goes on


def _until_idle(core: EngineCore, first: StepOps) -> list:
    results = [core.step(first)]
    while results[-1].stats.batch_rows:
        results.append(core.step(StepOps()))
    return results


def test_a_lone_prompt_whose_prefill_fails_apart_is_refused_alone(tiny_model_dir, monkeypatch):
    from mlxd.engine import apart as apart_module

    core = _lone_core(tiny_model_dir)
    real, calls = apart_module.prefill_step, []

    def failing(*args, **kwargs):
        calls.append(args[3])
        if len(calls) == 2:
            raise RuntimeError("no memory for this chunk")
        return real(*args, **kwargs)

    monkeypatch.setattr(apart_module, "prefill_step", failing)
    try:
        core.step(StepOps(starts=(_row("long", LONE),)))
        rest = _until_idle(core, StepOps(starts=(_row("short", [5, 6, 7, 8]),)))  # beside it; then a chunk fails
    finally:
        core.close()
    rejected = [r for result in rest for r in result.rejected]
    assert [r.request_id for r in rejected] == ["long"] and "no memory" in rejected[0].message
    assert len(_tokens(rest, "short")) == 2 and not _tokens(rest, "long") and len(calls) == 2
