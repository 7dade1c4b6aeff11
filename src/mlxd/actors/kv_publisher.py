"""The KV-event publisher actor: sends the cache tiers' block events over ZMQ PUB.

Frames are vLLM's: `[topic, seq (8 bytes big-endian), msgpack(KVEventBatch)]`,
so vLLM-speaking routers and indexers (Dynamo's KV indexer, llm-d's KV cache
manager) can follow every replica's cache. As in vLLM, an endpoint with a
wildcard host (`tcp://*:5557`) is bound and any other (`tcp://indexer:5557`)
is connected to, so many replicas can publish into one subscriber that binds;
unlike vLLM, the wildcard binds loopback unless every interface is allowed
(`kv.kv_events.PublishAddress`), and token ids are sent only when asked for.

A PUB socket never blocks: with no subscriber, or a slow one past the
high-water mark, ZMQ drops messages. Subscribers see a gap in `seq`.
"""

from __future__ import annotations

import time

import trio

from mlxd.kv.kv_events import AllBlocksCleared, PublishAddress, encode_batch, without_token_ids
from mlxd.runtime.kernel.messages import PublishKvEvents
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.kv_events")

HIGH_WATER_MARK = 100_000


class KvEventPublisherActor:
    def __init__(
        self,
        address: PublishAddress,
        *,
        inbox: trio.MemoryReceiveChannel[PublishKvEvents],
        topic: str = "",
        token_ids: bool = False,
        fingerprint: str = "",
    ) -> None:
        self.address = address
        self._topic = topic.encode()
        self._inbox = inbox
        self._token_ids = token_ids
        self._fingerprint = fingerprint  # logged: what a router needs to compute the block hashes
        self.stats = {"batches": 0, "events": 0, "send_failures": 0}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUB)
        sock.set_hwm(HIGH_WATER_MARK)
        try:
            if self.address.bind:
                sock.bind(self.address.url)
            else:
                sock.connect(self.address.url)
            log.info("kv_events.publishing", endpoint=self.address.url, bind=self.address.bind,
                     token_ids=self._token_ids, fingerprint=self._fingerprint)
            if self.address.every_interface:
                log.warning("kv_events.exposed", endpoint=self.address.url,
                            hint="anyone who can reach this port follows what this server caches; see SECURITY.md")
            seq = 0
            task_status.started()
            # A new incarnation holds nothing: indexers drop what they knew of this replica.
            first = PublishKvEvents(time.time(), (AllBlocksCleared(),))
            async with self._inbox:
                batch: PublishKvEvents | None = first
                while batch is not None:
                    seq = self._send(sock, seq, batch)
                    try:
                        batch = await self._inbox.receive()
                    except trio.EndOfChannel:
                        batch = None
        finally:
            sock.close(linger=0)
            ctx.term()

    def _send(self, sock, seq: int, batch: PublishKvEvents) -> int:
        import zmq

        events = batch.events if self._token_ids else without_token_ids(batch.events)
        payload = encode_batch(batch.ts, events)
        try:
            sock.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.stats["send_failures"] += 1  # past the high-water mark: dropped, seq still advances
        self.stats["batches"] += 1
        self.stats["events"] += len(batch.events)
        return seq + 1
