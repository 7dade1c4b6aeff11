"""KV cache events in vLLM's ZMQ/msgpack format, read back by a plain pyzmq + msgpack subscriber."""

from __future__ import annotations

import time

import attrs
import httpx
import msgpack
import pytest
import zmq

from mlxd.kv import blocks as bk
from mlxd.kv.kv_events import (
    RAM,
    SSD,
    BlockRemoved,
    BlockStored,
    ResidencyLedger,
    block_hashes,
    decode_batch,
    encode_batch,
)

from gateway import free_port
from serving import ServerThread, config_for


@attrs.define(eq=False)
class Entry:
    namespace: str
    tokens: tuple[int, ...]


def test_block_hashes_name_a_prefix_not_a_span():
    a = tuple(range(16))
    b = tuple(range(100, 116))
    assert block_hashes(a) == block_hashes(list(a)) == block_hashes(a + (1, 2, 3))
    assert block_hashes(a, "tenant-1") != block_hashes(a, "tenant-2")
    assert block_hashes(a, fingerprint="model-a") != block_hashes(a, fingerprint="model-b")
    # The same 16 tokens after different parents are different blocks.
    assert block_hashes(a + b)[1] != block_hashes(b + b)[1]
    assert all(0 <= h < 2**63 for h in block_hashes(tuple(range(200)), block_size=8))


def test_event_hashes_are_the_block_stores_names():
    """One chain: with the event block size equal to the store's span, events name the store's blocks."""
    tokens = [(5 * i + 1) % 97 for i in range(70)]
    spans = bk.choose_spans(tokens, namespace="ns", fingerprint="fp", exists=lambda _: False, block_tokens=16)
    full = [s.name for s in spans if s.end - s.start == 16]
    assert len(full) == 4 and spans[-1].end - spans[-1].start == 6  # the partial block has no event
    assert block_hashes(tokens, "ns", block_size=16, fingerprint="fp") == [bk.event_hash(n) for n in full]
    assert bk.event_hash(full[0]) == int(full[0][:16], 16) & (2**63 - 1)


def test_ledger_announces_each_block_once_per_medium():
    ledger = ResidencyLedger(block_size=4)
    short = Entry("", tuple(range(10)))  # 2 full blocks
    long = Entry("", tuple(range(17)))  # 4 full blocks, the first 2 shared with `short`
    hashes = block_hashes(long.tokens, block_size=4)

    [stored] = ledger.sync(RAM, [short])
    assert stored == BlockStored(tuple(hashes[:2]), None, tuple(range(8)), 4, RAM)
    [stored] = ledger.sync(RAM, [short, long])
    assert stored == BlockStored(tuple(hashes[2:]), hashes[1], tuple(range(8, 16)), 4, RAM)
    assert ledger.sync(RAM, [short, long]) == []
    assert ledger.sync(RAM, [long]) == []  # `long` still covers the shared blocks
    [stored] = ledger.sync(SSD, [Entry("", tuple(range(9)))])  # another medium counts apart
    assert stored.medium == SSD and stored.block_hashes == tuple(hashes[:2])
    [removed] = ledger.sync(RAM, [])
    assert removed == BlockRemoved(tuple(hashes), RAM)
    assert ledger.blocks(SSD) == set(hashes[:2])


def test_batch_layout_is_vllms_array_like_msgpack():
    events = [BlockStored((7, 8), None, tuple(range(8)), 4, RAM), BlockRemoved((5,), SSD)]
    raw = msgpack.unpackb(encode_batch(12.5, events))
    assert raw == [12.5, [["BlockStored", [7, 8], None, list(range(8)), 4, None, "RAM", None],
                          ["BlockRemoved", [5], "SSD"]]]
    assert decode_batch(encode_batch(12.5, events)) == (12.5, events)


class Subscriber:
    """An independent vLLM-style subscriber: binds SUB, decodes frames with plain msgpack."""

    def __init__(self) -> None:
        self.port = free_port()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.seqs: list[int] = []
        self.events: list[list] = []

    def wait_connected(self, timeout: float = 60.0) -> None:
        """Until a publisher has connected (ZMQ drops what a PUB sends before that: the slow joiner)."""
        assert self.monitor.poll(int(timeout * 1000)), "no publisher connected"
        self.monitor.recv_multipart()
        # A ZMQ socket acts on a new peer (here: sends it our subscription) only when
        # called, as a subscriber's receive loop does; until then the PUB drops everything.
        end = time.monotonic() + 0.5
        self.drain(lambda: time.monotonic() > end)

    def drain(self, until, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, f"events so far: {self.events}"
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == b""
                self.seqs.append(int.from_bytes(seq, "big"))
                ts, events = msgpack.unpackb(payload)[:2]
                assert ts > 1e9
                self.events.extend(events)

    def of(self, kind: str, medium: str | None = None) -> list[list]:
        return [e for e in self.events if e[0] == kind and (medium is None or e[-1 if kind == "BlockRemoved" else 6] == medium)]

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


def test_live_server_publishes_ram_ssd_and_removal_events(tiny_model_dir, tmp_path):
    sub = Subscriber()
    prompt = [(7 * i + 3) % 200 + 10 for i in range(70)]
    # Block layout with the event block size as its span: events and SSD blocks share one chain.
    config = config_for(tiny_model_dir, ssd_cache_dir=tmp_path / "ssd", ssd_demote_idle_s=1.0,
                        ssd_layout="blocks", ssd_block_tokens=16,
                        kv_events_endpoint=f"tcp://127.0.0.1:{sub.port}", kv_events_token_ids=True)
    try:
        with ServerThread(config) as server:
            base = server.base_url
            sub.wait_connected()
            r = httpx.post(f"{base}/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                         "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            sub.drain(lambda: sub.of("BlockStored", RAM))
            stored = sub.of("BlockStored", RAM)
            first = stored[0]
            hashes, parent, token_ids, block_size = first[1], first[2], first[3], first[4]
            assert block_size == 16 and parent is None
            assert token_ids[:64] == prompt[:64] and len(token_ids) == 16 * len(hashes)
            [fp_dir] = [d for d in (tmp_path / "ssd").iterdir() if d.is_dir()]
            assert hashes == block_hashes(prompt, block_size=16, fingerprint=fp_dir.name)[:len(hashes)]
            ram_blocks = {h for e in stored for h in e[1]}
            for e in stored[1:]:  # every later run hangs off a block already announced
                assert e[2] in ram_blocks

            flush = httpx.post(f"{base.removesuffix('/v1')}/admin/cache/flush", timeout=120)
            assert flush.status_code == 200, flush.text
            sub.drain(lambda: sub.of("BlockStored", SSD))
            ssd_blocks = {h for e in sub.of("BlockStored", SSD) for h in e[1]}
            assert hashes[0] in ssd_blocks
            # Every SSD block announced is a block file of the store, by the same name.
            on_disk = {bk.event_hash(p.stem) for p in (fp_dir / "blocks").glob("*.mlxblk")}
            assert len(ssd_blocks) >= 4 and ssd_blocks <= on_disk

            # Idle demotion drops the RAM copy (the SSD copy stays): BlockRemoved on RAM only.
            sub.drain(lambda: sub.of("BlockRemoved", RAM), timeout=60)
            removed = {h for e in sub.of("BlockRemoved", RAM) for h in e[1]}
            assert hashes[0] in removed
            assert not sub.of("BlockRemoved", SSD)
        assert sub.seqs == sorted(sub.seqs) and len(set(sub.seqs)) == len(sub.seqs)
    finally:
        sub.close()


def test_a_bad_endpoint_is_refused_before_serving():
    from mlxd.cli import build_parser, serve_config

    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        serve_config(build_parser().parse_args(["serve", "--kv-events-endpoint", "localhost:5557"]))
