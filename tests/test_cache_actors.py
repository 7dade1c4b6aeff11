"""The cache owner, the durability coordinator and the SSD writer as actors (trio, mock clock)."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import pytest
import trio
import trio.testing
from mlx_lm.models import cache as mlc

from mlxd.actors.cache_owner import CacheOwnerActor
from mlxd.actors.durability import DurabilityCoordinator
from mlxd.actors.ssd_writer import SsdWriterActor
from mlxd.kv import file_format as ff
from mlxd.kv import kinds
from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.ssd_store import Failed, SsdStore, Stored, StoreIdentity
from mlxd.kv.tiers import CacheTiers, SsdRecord
from mlxd.kv.write_queue import WriteQueue
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.channels import Reply
from mlxd.runtime.kernel.messages import (
    CacheOwnerMessage,
    CacheStatsSnapshot,
    DurabilityMessage,
    DurabilitySnapshot,
    DurabilityStats,
    EntryDurable,
    EntryNotPersisted,
    FlushReport,
    FlushRequest,
    ForgetDirty,
    LookupPrefix,
    MarkDirty,
    MarkNotStored,
    PrefetcherMessage,
    PrefetchHint,
    PrefetchRecord,
    PrefixLookup,
    PublishPrefix,
    QueryCacheStats,
    SnapshotWritten,
    WriterStats,
    WriteSnapshot,
)

IDENTITY = StoreIdentity(model_id="m", fingerprint="f" * 32, tokenizer_hash="t")


def plan_for(tokens: tuple[int, ...], n_heads: int = 1) -> ff.SnapshotPlan:
    c = mlc.KVCache()
    c.update_and_fetch(mx.zeros((1, n_heads, len(tokens), 8)), mx.zeros((1, n_heads, len(tokens), 8)))
    return kinds.plan_snapshot([c], meta=IDENTITY.meta(tokens, ""))


def publish(tokens: tuple[int, ...], **kw) -> PublishPrefix:
    plan = plan_for(tokens)
    return PublishPrefix(tokens, "", payload=[], nbytes=plan.nbytes, trimmable=True, reason="final", plan=plan, **kw)


async def ask(channel, make):
    reply: Reply = Reply()
    await channel.send(make(reply))
    return await reply.wait()


async def start_owner(nursery, config: RuntimeConfig, *, ssd: bool = True):
    """A cache owner whose SSD store touches no files (the records here have no path)."""
    inbox_send, inbox = trio.open_memory_channel[CacheOwnerMessage](64)
    durable_send, durable_receive = trio.open_memory_channel[DurabilityMessage](math.inf)
    prefetch_send, prefetch_receive = trio.open_memory_channel[PrefetcherMessage](8)
    store = SsdStore(Path("/nonexistent-mlxd-test"), IDENTITY) if ssd else None
    owner = CacheOwnerActor(config, inbox=inbox, store=store, durability=durable_send, prefetcher=prefetch_send)
    await nursery.start(owner.run)
    return owner, inbox_send, durable_receive, prefetch_receive


async def test_cache_owner_persists_before_demotion_and_tells_the_prefetcher(autojump_clock):
    config = RuntimeConfig(prompt_cache_bytes=600, ssd_cache_dir=Path("/unused"), ssd_demote_idle_s=0)
    async with trio.open_nursery() as nursery:
        owner, inbox, durability, prefetcher = await start_owner(nursery, config)
        a, b = tuple(range(10)), tuple(range(100, 110))
        await inbox.send(publish(a))
        await inbox.send(publish(b))  # 2 x 320 bytes > 600: a waits for its write
        marks = [await durability.receive(), await durability.receive()]
        assert [type(m) for m in marks] == [MarkDirty, MarkDirty] and marks[0].tokens == a
        stats = await ask(inbox, QueryCacheStats)
        assert stats.tiers.ram.entries == 2
        await inbox.send(EntryDurable(SsdRecord("", a, marks[0].nbytes, 0.0)))
        stats = await ask(inbox, QueryCacheStats)
        assert stats.tiers.ram.entries == 1 and stats.tiers.demotions == 1
        # A returning prompt: the owner sends the prefetcher the record to read.
        await inbox.send(PrefetchHint(a + (5,), ""))
        msg = await prefetcher.receive()
        assert isinstance(msg, PrefetchRecord) and msg.record.tokens == a
        lookup = await ask(inbox, lambda r: LookupPrefix(a + (5,), "", r))
        assert isinstance(lookup, PrefixLookup) and lookup.restore.usable == 10
        nursery.cancel_scope.cancel()


async def test_cache_owner_survives_a_failing_handler(autojump_clock):
    config = RuntimeConfig(prompt_cache_bytes=10_000)
    async with trio.open_nursery() as nursery:
        _, inbox, _, _ = await start_owner(nursery, config, ssd=False)
        bad = LookupPrefix(None, "", Reply())  # type: ignore[arg-type]
        await inbox.send(bad)
        try:
            await bad.reply.wait()
            raise AssertionError("the bad lookup should fail its reply")
        except TypeError:
            pass
        ok = await ask(inbox, lambda r: LookupPrefix((1, 2, 3), "", r))
        assert ok.hit is None  # the actor is still serving
        nursery.cancel_scope.cancel()


async def test_cache_owner_reports_an_entry_too_large_for_the_ssd_cap(autojump_clock):
    config = RuntimeConfig(prompt_cache_bytes=10_000, ssd_cache_dir=Path("/unused"), ssd_cache_max_bytes=100)
    async with trio.open_nursery() as nursery:
        _, inbox, durability, _ = await start_owner(nursery, config)
        await inbox.send(publish(tuple(range(10))))  # 320 bytes > the 100-byte cap
        msg = await durability.receive()
        assert isinstance(msg, MarkNotStored) and "SSD cap" in msg.reason
        nursery.cancel_scope.cancel()


async def start_coordinator(nursery):
    inbox_send, inbox = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer_send, writer = trio.open_memory_channel[WriteSnapshot](1)
    cache_send, cache = trio.open_memory_channel[CacheOwnerMessage](64)
    coordinator = DurabilityCoordinator(inbox=inbox, writer=writer_send, cache=cache_send)
    await nursery.start(coordinator.run)
    return inbox_send, writer, cache


async def mark_two_dirty(inbox) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two unwritten checkpoints (tokens 0..9, then 20..29) told to the coordinator, oldest first."""
    a, b = tuple(range(10)), tuple(range(20, 30))
    await inbox.send(MarkDirty("", a, plan_for(a), True, 320))
    await inbox.send(MarkDirty("", b, plan_for(b), True, 320))
    return a, b


async def answer_stats(cache, entries: int = 1) -> None:
    """Play the cache owner's part of a flush: report what the SSD holds."""
    msg = await cache.receive()
    assert isinstance(msg, QueryCacheStats)
    tiers = CacheTiers(PromptCache(max_bytes=1), ssd=True)
    msg.reply.send(CacheStatsSnapshot(tiers.stats(), {}, 0, None, 0))


async def test_flush_waits_for_writes_and_carries_the_cause_of_a_failure(autojump_clock):
    async with trio.open_nursery() as nursery:
        inbox, writer, cache = await start_coordinator(nursery)
        a, b = await mark_two_dirty(inbox)
        job_a = await writer.receive()
        assert job_a.job.record.tokens == a  # oldest first, one at a time
        flush: Reply[FlushReport] = Reply()
        await inbox.send(FlushRequest(flush))
        answered: list[FlushReport] = []

        async def wait_flush() -> None:
            answered.append(await flush.wait())

        nursery.start_soon(wait_flush)
        await trio.sleep(5)
        assert not answered  # two writes are pending: the flush waits
        record = SsdRecord("", a, 320, 0.0)
        await inbox.send(SnapshotWritten(job_a.job, Stored(record, 0.01), 0.01, WriterStats(writes=1)))
        assert (await cache.receive()).record is record  # EntryDurable to the cache owner
        job_b = await writer.receive()
        error = "writing x.mlxkv.tmp: [Errno 30] Read-only file system"
        await inbox.send(SnapshotWritten(job_b.job, Failed(error), 0.01, WriterStats(failures=1)))
        not_persisted = await cache.receive()
        assert isinstance(not_persisted, EntryNotPersisted) and not_persisted.reason == error
        await answer_stats(cache)
        await trio.testing.wait_all_tasks_blocked()
        (report,) = answered
        assert not report.durable and report.failed == 1 and report.reason == error
        stats = await ask(inbox, DurabilityStats)
        assert isinstance(stats, DurabilitySnapshot) and stats.spills == 1 and stats.failed_spills == 1
        nursery.cancel_scope.cancel()


async def test_flush_reports_dropped_and_never_stored_checkpoints(autojump_clock):
    async with trio.open_nursery() as nursery:
        inbox, writer, cache = await start_coordinator(nursery)
        a, b = await mark_two_dirty(inbox)
        job_a = await writer.receive()
        await inbox.send(ForgetDirty("", b))  # b left RAM before its write
        await inbox.send(MarkNotStored("", (7,), "9 bytes exceed the SSD cap of 8"))
        await inbox.send(SnapshotWritten(job_a.job, Stored(SsdRecord("", a, 320, 0.0), 0.0), 0.0, WriterStats()))
        await cache.receive()
        flush: Reply[FlushReport] = Reply()
        await inbox.send(FlushRequest(flush))
        await answer_stats(cache)
        report = await flush.wait()
        assert not report.durable and report.pending == 0 and report.dropped == 2
        assert "SSD cap" in report.reason
        # Reported once: the next flush, with nothing new, is durable.
        again: Reply[FlushReport] = Reply()
        await inbox.send(FlushRequest(again))
        await answer_stats(cache)
        assert (await again.wait()).durable
        nursery.cancel_scope.cancel()


async def test_a_flush_waits_for_the_descendant_that_superseded_its_target(autojump_clock):
    """A flush waits for a queued record; a trimmable descendant published after the flush
    supersedes that record in the queue. The flush must then wait for the descendant: until
    it is written, neither file holds the state the flush was asked to make durable."""
    async with trio.open_nursery() as nursery:
        inbox, writer, cache = await start_coordinator(nursery)
        x, a = tuple(range(50, 60)), tuple(range(10))
        longer = a + (10, 11, 12)
        await inbox.send(MarkDirty("", x, plan_for(x), True, 320))
        job_x = await writer.receive()  # x is being written; a waits in the queue
        await inbox.send(MarkDirty("", a, plan_for(a), True, 320))
        flush: Reply[FlushReport] = Reply()
        await inbox.send(FlushRequest(flush))
        await inbox.send(MarkDirty("", longer, plan_for(longer), True, 416))  # supersedes queued a
        await inbox.send(SnapshotWritten(job_x.job, Stored(SsdRecord("", x, 320, 0.0), 0.0), 0.0, WriterStats()))
        assert isinstance(await cache.receive(), EntryDurable)
        job_longer = await writer.receive()
        assert job_longer.job.record.tokens == longer
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.WouldBlock):  # no stats query: the flush is still waiting
            cache.receive_nowait()
        stored = SsdRecord("", longer, 416, 0.0)
        await inbox.send(SnapshotWritten(job_longer.job, Stored(stored, 0.0), 0.0, WriterStats()))
        assert (await cache.receive()).record is stored
        await answer_stats(cache)
        report = await flush.wait()
        assert report.durable and report.pending == 0
        nursery.cancel_scope.cancel()


async def test_a_paced_write_stops_when_the_runtime_is_cancelled(tmp_path):
    """Hole (c): a cancelled runtime must not keep a paced write crawling at its rate."""
    store = SsdStore(tmp_path, IDENTITY)
    governor = WriteGovernor(busy_rate_bytes_per_s=1024)  # 1 KiB/s: a 256 KiB file would take minutes
    governor.set_busy(True)
    inbox_send, inbox = trio.open_memory_channel[WriteSnapshot](1)
    out_send, out = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer = SsdWriterActor(store, inbox=inbox, outbox=out_send, governor=governor)
    tokens = tuple(range(2048))
    queue = WriteQueue()
    queue.mark("", tokens, plan=plan_for(tokens, n_heads=8), trimmable=True, nbytes=0)
    job = queue.next_job()
    with trio.fail_after(60):  # before the fix: the thread crawls on (minutes) and this times out
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            await inbox_send.send(WriteSnapshot(job))
            while governor.bytes_out == 0:  # noqa: ASYNC110 - a writer thread's state (it cannot set a trio.Event)
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()  # the first slice is out; the pacer is now waiting
    assert writer.stopping.is_set()
    assert not list(tmp_path.rglob("*.mlxkv")) and not list(tmp_path.rglob("*.tmp"))


def test_messages_are_typed_without_any():
    import ast

    import mlxd.runtime.kernel.messages as messages

    tree = ast.parse(Path(messages.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "Any" not in names  # every message field says what it carries


def test_the_write_queue_runs_several_writes_but_never_two_of_one_key():
    queue = WriteQueue()
    keys = [tuple(range(i, i + 4)) for i in (0, 10, 20)]
    for tokens in keys:
        queue.mark("", tokens, plan=None, trimmable=False, nbytes=10)
    first = queue.next_job(limit=2)
    second = queue.next_job(limit=2)
    assert first is not None and second is not None
    assert queue.next_job(limit=2) is None and queue.writing == 2  # the limit holds
    assert queue.next_job() is None  # the default is one write at a time
    queue.mark("", keys[0], plan=None, trimmable=False, nbytes=10)  # a newer version of a key in flight
    queue.written(second.key, second.version, stored=True)
    third = queue.next_job(limit=2)
    assert third is not None and third.record.tokens == keys[2]  # not keys[0] again while it is written
    queue.written(first.key, first.version, stored=False, error="EIO")
    again = queue.next_job(limit=2)
    assert again is not None and again.record.tokens == keys[0] and again.version > first.version


async def test_a_flush_sends_several_writes_while_paced_write_behind_sends_one(autojump_clock):
    governor = WriteGovernor(busy_rate_bytes_per_s=1024)
    governor.set_busy(True)
    inbox, writer_receive = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer_send, writer = trio.open_memory_channel[WriteSnapshot](1)
    cache_send, _cache = trio.open_memory_channel[CacheOwnerMessage](64)
    coordinator = DurabilityCoordinator(inbox=writer_receive, writer=writer_send, cache=cache_send,
                                        governor=governor, writers=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        tokens = [tuple(range(i, i + 10)) for i in (0, 100, 200, 300)]
        for t in tokens:
            await inbox.send(MarkDirty("", t, plan_for(t), False, 320))
        first = await writer.receive()
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.WouldBlock):  # paced write-behind: one at a time
            writer.receive_nowait()
        await inbox.send(FlushRequest(Reply()))
        more = [await writer.receive(), await writer.receive()]  # the flush: up to 3 in flight
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.WouldBlock):
            writer.receive_nowait()
        assert [j.job.record.tokens for j in (first, *more)] == tokens[:3]
        record = SsdRecord("", tokens[0], 320, 0.0)
        await inbox.send(SnapshotWritten(first.job, Stored(record, 0.0), 0.0, WriterStats(writes=1)))
        assert (await writer.receive()).job.record.tokens == tokens[3]  # one finished, the next starts
        nursery.cancel_scope.cancel()


async def test_the_writer_writes_several_files_at_once_on_its_workers(tmp_path):
    """Three paced writes on three workers: each one's first slice is out before any finishes."""
    store = SsdStore(tmp_path, IDENTITY)
    governor = WriteGovernor(busy_rate_bytes_per_s=1024)  # each write then waits minutes after its slice
    governor.set_busy(True)
    inbox_send, inbox = trio.open_memory_channel[WriteSnapshot](1)
    out_send, out = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer = SsdWriterActor(store, inbox=inbox, outbox=out_send, governor=governor, workers=3)
    queue = WriteQueue()
    for i in range(3):
        tokens = tuple(range(i * 1000, i * 1000 + 256))
        queue.mark("", tokens, plan=plan_for(tokens, n_heads=8), trimmable=True, nbytes=0)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            for _ in range(3):
                await inbox_send.send(WriteSnapshot(queue.next_job(limit=3)))
            for _ in range(1200):  # one worker would hold the second job back (for minutes)
                if len(list(tmp_path.rglob("*.tmp"))) == 3:
                    break
                await trio.sleep(0.05)
            assert len(list(tmp_path.rglob("*.tmp"))) == 3  # three writes in flight at once
            governor.set_busy(False)  # full speed: all three finish
            written = [await out.receive() for _ in range(3)]
            nursery.cancel_scope.cancel()
    assert all(isinstance(w.outcome, Stored) for w in written)
    assert len(list(tmp_path.rglob("*.mlxkv"))) == 3 and not list(tmp_path.rglob("*.tmp"))


async def test_writes_finishing_out_of_order_reach_the_cache_owner_in_start_order(autojump_clock):
    """The tier core indexes each file as the most recently used and enforces the SSD cap as it goes,
    so the writers' finishing order must not decide what it keeps (the simulator has one writer)."""
    inbox, writer_receive = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer_send, writer = trio.open_memory_channel[WriteSnapshot](1)
    cache_send, cache = trio.open_memory_channel[CacheOwnerMessage](64)
    coordinator = DurabilityCoordinator(inbox=writer_receive, writer=writer_send, cache=cache_send, writers=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        tokens = [tuple(range(i, i + 10)) for i in (0, 100, 200)]
        for t in tokens:
            await inbox.send(MarkDirty("", t, plan_for(t), False, 320))
        reply: Reply[FlushReport] = Reply()
        await inbox.send(FlushRequest(reply))
        jobs = [await writer.receive() for _ in tokens]
        assert [j.job.record.tokens for j in jobs] == tokens
        for job in reversed(jobs):  # the last started finishes first
            record = SsdRecord("", job.job.record.tokens, 320, 0.0)
            await inbox.send(SnapshotWritten(job.job, Stored(record, 0.0), 0.0, WriterStats(writes=1)))
            await trio.testing.wait_all_tasks_blocked()
            if job is not jobs[0]:
                with pytest.raises(trio.WouldBlock):  # held back behind the first write
                    cache.receive_nowait()
        sent = [cache.receive_nowait() for _ in tokens]
        assert [m.record.tokens for m in sent] == tokens
        query = await cache.receive()  # the flush asks the cache owner what it holds only now
        assert isinstance(query, QueryCacheStats)
        nursery.cancel_scope.cancel()


def test_a_record_extending_a_pending_one_adds_only_its_own_bytes_to_the_backlog_where_blocks_are_shared():
    """A prompt's boundary checkpoint is being written when its final one (4 tokens longer) is queued: with the
    blocks layout the final is one new block on disk, so the backlog counts what it adds, not the prompt twice
    (whole files rewrite it all: counted twice). Chains count once, other conversations in full."""
    boundary, final = tuple(range(8192)), tuple(range(8196))
    for shared, expect in ((True, 1000 + 4), (False, 1000 + 1004)):
        queue = WriteQueue(shared_prefixes=shared)
        queue.mark("", boundary, plan=None, trimmable=True, nbytes=1000)
        assert queue.next_job() is not None  # writing: the final cannot supersede it
        queue.mark("", final, plan=None, trimmable=True, nbytes=1004)
        assert len(queue.pending()) == 2 and queue.pending_bytes() == expect
    queue = WriteQueue(shared_prefixes=True)
    for n, nbytes in ((100, 100), (200, 200), (300, 300)):  # each writing before the next arrives
        queue.mark("a", tuple(range(n)), plan=None, trimmable=True, nbytes=nbytes)
        queue.next_job(limit=3)
    queue.mark("b", tuple(range(300)), plan=None, trimmable=True, nbytes=300)  # another namespace: its own
    queue.mark("a", (7, *range(299)), plan=None, trimmable=True, nbytes=300)  # no prefix of it is pending
    assert queue.pending_bytes() == 300 + 300 + 300
    job = queue.next_job(limit=4)
    assert job is not None and job.record.namespace == "b"
    queue.written(job.key, job.version, stored=False, error="EIO")  # failed: not pending any more
    assert queue.pending_bytes() == 300 + 300


async def test_one_prompt_s_boundary_and_final_checkpoints_do_not_make_the_backlog_urgent(autojump_clock):
    """The coordinator with shared prefixes (the blocks layout): a prompt's two checkpoints together pass the
    backlog bound only if counted twice, so write-behind stays paced beside decode; whole files: urgent."""
    for shared, urgent in ((True, False), (False, True)):
        governor = WriteGovernor(busy_rate_bytes_per_s=1024)
        governor.set_busy(True)
        inbox, writer_receive = trio.open_memory_channel[DurabilityMessage](math.inf)
        writer_send, writer = trio.open_memory_channel[WriteSnapshot](1)
        cache_send, _cache = trio.open_memory_channel[CacheOwnerMessage](64)
        coordinator = DurabilityCoordinator(inbox=writer_receive, writer=writer_send, cache=cache_send,
                                            governor=governor, backlog_bytes=1500, shared_prefixes=shared)
        async with trio.open_nursery() as nursery:
            await nursery.start(coordinator.run)
            boundary, final = tuple(range(64)), tuple(range(68))
            await inbox.send(MarkDirty("", boundary, plan_for(boundary), True, 1000))
            await writer.receive()  # its write began
            await inbox.send(MarkDirty("", final, plan_for(final), True, 1004))
            await trio.testing.wait_all_tasks_blocked()
            assert ("backlog" in governor.urgent) is urgent
            assert (governor.rate() is None) is urgent  # paced beside decode unless urgent
            nursery.cancel_scope.cancel()


def test_the_backlog_bound_is_a_serve_flag():
    """`--ssd-backlog-gb`: the dirty bytes past which write-behind is urgent (default: half the RAM tier)."""
    from mlxd.cli import build_parser, serve_config

    parser = build_parser()
    assert serve_config(parser.parse_args(["serve", "--ssd-cache", "/d"])).ssd_backlog_bytes == 0
    config = serve_config(parser.parse_args(["serve", "--ssd-cache", "/d", "--ssd-backlog-gb", "0.5"]))
    assert config.ssd_backlog_bytes == 1 << 29


@pytest.mark.parametrize("flag", ["--ssd-backlog-gb", "--prompt-cache-gb", "--ssd-write-rate"])
@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_a_size_or_rate_that_is_not_a_finite_number_is_a_usage_error(flag, value, capsys):
    """argparse's usage error (exit 2, the flag named), not an OverflowError's traceback from int(inf)."""
    from mlxd.cli import build_parser, serve_config

    with pytest.raises(SystemExit) as info:
        serve_config(build_parser().parse_args(["serve", "--ssd-cache", "/d", flag, value]))
    assert info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_the_backlog_with_shared_prefixes_counts_what_each_record_adds_to_its_longest_pending_prefix():
    """`pending_bytes` against its definition (each pending record adds its bytes beyond the most bytes among
    its pending strict prefixes of the same namespace), on chains, branches, namespaces and failed records."""
    import random

    rng = random.Random(7)
    queue = WriteQueue(shared_prefixes=True)
    stems = [tuple(rng.randrange(50) for _ in range(rng.randrange(1, 6))) for _ in range(12)]
    for _ in range(160):
        tokens = rng.choice(stems) + tuple(rng.randrange(3) for _ in range(rng.randrange(0, 8)))
        queue.mark(rng.choice("ab"), tokens, plan=None, trimmable=rng.random() < 0.3, nbytes=rng.randrange(1, 500))
        if rng.random() < 0.6:  # writing: a longer record does not supersede it
            job = queue.next_job(limit=1000)
            if job is not None and rng.random() < 0.2:
                queue.written(job.key, job.version, stored=False, error="EIO")
    pending = queue.pending()
    assert len(pending) > 40 and len({r.namespace for r in pending}) == 2
    expect = 0
    for r in pending:
        prefixes = [o.nbytes for o in pending if o.namespace == r.namespace and len(o.tokens) < len(r.tokens)
                    and tuple(r.tokens[: len(o.tokens)]) == tuple(o.tokens)]
        expect += max(0, r.nbytes - max(prefixes, default=0))
    assert queue.pending_bytes() == expect


async def test_a_failure_handling_a_write_s_outcome_answers_the_waiting_flush_not_durable(autojump_clock):
    """A write's outcome that its handler cannot take (here an outcome of no known kind) used to leave the
    write in flight for ever: the waiting flush was never answered and SIGTERM waited out its whole timeout.
    Now every waiting flush is answered at once, not durable, with the cause; the coordinator keeps serving."""
    with trio.fail_after(60):  # on the mock clock: a hang fails the test rather than the run
        await _flush_after_a_failing_outcome_handler()


async def _flush_after_a_failing_outcome_handler() -> None:
    async with trio.open_nursery() as nursery:
        inbox, writer, cache = await start_coordinator(nursery)
        a, b = await mark_two_dirty(inbox)
        job_a = await writer.receive()
        flush: Reply[FlushReport] = Reply()
        await inbox.send(FlushRequest(flush))
        await inbox.send(SnapshotWritten(job_a.job, object(), 0.0, WriterStats()))  # type: ignore[arg-type]
        with trio.fail_after(1):  # on the mock clock: it is answered without any other message
            report = await flush.wait()
        assert not report.durable and "AttributeError" in (report.reason or "")
        # Still serving: the failed write is retried by the next flush, which is answered as usual.
        again: Reply[FlushReport] = Reply()
        await inbox.send(FlushRequest(again))
        written = []
        for _ in (a, b):  # one writer: one write at a time
            job = await writer.receive()
            written.append(job.job.record.tokens)
            stored = SsdRecord("", job.job.record.tokens, 320, 0.0)
            await inbox.send(SnapshotWritten(job.job, Stored(stored, 0.0), 0.0, WriterStats(writes=1)))
            assert isinstance(await cache.receive(), EntryDurable)
        assert sorted(written) == [a, b]
        await answer_stats(cache)
        assert (await again.wait()).durable
        nursery.cancel_scope.cancel()
