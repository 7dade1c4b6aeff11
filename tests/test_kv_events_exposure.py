"""KV events expose no more than asked: loopback unless every interface is allowed, and no
token ids (the prompts themselves) unless asked for."""

from __future__ import annotations

import socket
import time

import httpx
import msgpack
import pytest
import trio
import zmq

from mlxd.actors.kv_publisher import KvEventPublisherActor
from mlxd.kv.kv_events import RAM, BlockStored, PublishAddress, block_hashes
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.messages import PublishKvEvents

from gateway import free_port
from serving import ServerThread, config_for


def test_a_wildcard_binds_loopback_unless_every_interface_is_allowed():
    assert PublishAddress.of("tcp://*:5557") == PublishAddress("tcp://127.0.0.1:5557", bind=True)
    assert PublishAddress.of("tcp://*:5557", all_interfaces=True) == PublishAddress(
        "tcp://*:5557", bind=True, every_interface=True)
    assert PublishAddress.of("tcp://0.0.0.0:5557", all_interfaces=True).every_interface
    for everywhere in ("tcp://0.0.0.0:5557", "tcp://[::]:5557"):
        with pytest.raises(ValueError, match="every network interface.*--kv-events-all-interfaces"):
            PublishAddress.of(everywhere)
    # Any named host is connected to (an indexer that binds), as in vLLM; ipc:// binds a Unix socket.
    assert PublishAddress.of("tcp://indexer:5557") == PublishAddress("tcp://indexer:5557", bind=False)
    assert PublishAddress.of("tcp://127.0.0.1:5557").bind is False
    assert PublishAddress.of("ipc:///run/mlxd/kv.sock") == PublishAddress("ipc:///run/mlxd/kv.sock", bind=True)
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        PublishAddress.of("tcp://5557")


def test_config_and_cli_refuse_an_all_interfaces_bind_without_the_flag():
    from mlxd.cli import build_parser, serve_config

    with pytest.raises(ValueError, match="every network interface"):
        RuntimeConfig(kv_events_endpoint="tcp://0.0.0.0:5557")
    assert RuntimeConfig(kv_events_endpoint="tcp://0.0.0.0:5557", kv_events_all_interfaces=True)

    def parse(*flags: str) -> RuntimeConfig:
        return serve_config(build_parser().parse_args(["serve", *flags]))

    with pytest.raises(ValueError, match="--kv-events-all-interfaces"):
        parse("--kv-events-endpoint", "tcp://0.0.0.0:5557")
    documented = parse("--kv-events-endpoint", "tcp://*:5557")
    assert documented.kv_events_address() == PublishAddress("tcp://127.0.0.1:5557", bind=True)
    assert documented.kv_events_token_ids is False
    exposed = parse("--kv-events-endpoint", "tcp://*:5557", "--kv-events-all-interfaces", "--kv-events-token-ids", "on")
    assert exposed.kv_events_address().every_interface and exposed.kv_events_token_ids


def outward_address() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


STORED = BlockStored((11, 12), None, tuple(range(32)), 16, RAM)


async def publish_and_receive(config: RuntimeConfig, port: int) -> tuple[list, bool | None]:
    """Run the publisher for `config`; a SUB on 127.0.0.1 reads one BlockStored. Also says
    whether the port answers on the machine's outward address (None: no such address)."""
    send, receive = trio.open_memory_channel[PublishKvEvents](8)
    publisher = KvEventPublisherActor(config.kv_events_address(), inbox=receive,
                                      token_ids=config.kv_events_token_ids)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(publisher.run)
            outward = outward_address()
            exposed = None if outward is None else await trio.to_thread.run_sync(reachable, outward, port)
            sub.connect(f"tcp://127.0.0.1:{port}")
            deadline = time.monotonic() + 60
            while True:  # until the subscription reaches the PUB (ZMQ's slow joiner)
                assert time.monotonic() < deadline, "no event arrived"
                await send.send(PublishKvEvents(time.time(), (STORED,)))
                if await trio.to_thread.run_sync(sub.poll, 100):
                    _topic, _seq, payload = sub.recv_multipart()
                    events = msgpack.unpackb(payload)[1]
                    if events[0][0] == "BlockStored":
                        break
            nursery.cancel_scope.cancel()
    finally:
        sub.close(linger=0)
        ctx.term()
    return events[0], exposed


async def test_the_documented_endpoint_binds_loopback_and_sends_no_token_ids():
    port = free_port()
    config = RuntimeConfig(kv_events_endpoint=f"tcp://*:{port}")
    stored, exposed = await publish_and_receive(config, port)
    assert stored[1] == [11, 12] and stored[4] == 16  # hashes and block size as before
    assert stored[3] == []  # no token ids
    if exposed is None:
        pytest.skip("no non-loopback address to check the bind against")
    assert exposed is False


async def test_every_interface_and_token_ids_when_asked_for():
    port = free_port()
    config = RuntimeConfig(kv_events_endpoint=f"tcp://*:{port}", kv_events_all_interfaces=True,
                           kv_events_token_ids=True)
    stored, exposed = await publish_and_receive(config, port)
    assert stored[3] == list(range(32))
    assert exposed in (True, None)


def test_a_live_server_announces_blocks_without_the_prompt(tiny_model_dir):
    """The default: a subscriber learns which blocks a replica holds, not the prompt's tokens."""
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    prompt = [(11 * i + 5) % 200 + 10 for i in range(40)]
    stored: list = []

    def receive(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if sub.poll(50):
                events = msgpack.unpackb(sub.recv_multipart()[2])[1]
                stored.extend(e for e in events if e[0] == "BlockStored")

    try:
        with ServerThread(config_for(tiny_model_dir, kv_events_endpoint=f"tcp://127.0.0.1:{port}")) as server:
            assert monitor.poll(60_000), "the server never connected"
            receive(0.5)  # our subscription reaches the server's PUB while we receive (ZMQ's slow joiner)
            r = httpx.post(f"{server.base_url}/completions", timeout=120,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 60
            while not stored and time.monotonic() < deadline:
                receive(0.2)
            fingerprint = server.runtime.info.store_identity.fingerprint
        assert stored, "no BlockStored event"
        hashes = [h for e in stored for h in e[1]]
        assert hashes[:2] == block_hashes(prompt, block_size=16, fingerprint=fingerprint)[:2]
        assert all(e[3] == [] for e in stored), stored
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)
        ctx.term()
