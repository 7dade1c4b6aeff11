"""The KV-event publisher actor: sends the cache tiers' block events over ZMQ PUB.

Frames are vLLM's: `[topic, seq (8 bytes big-endian), msgpack(KVEventBatch)]`,
so vLLM-speaking routers and indexers (Dynamo's KV indexer, llm-d's KV cache
manager) can follow every replica's cache. Like vLLM, an endpoint with a
wildcard host (`tcp://*:5557`) is bound and any other (`tcp://indexer:5557`)
is connected to, so many replicas can publish into one subscriber that binds.

A PUB socket never blocks: with no subscriber, or a slow one past the
high-water mark, ZMQ drops messages. Subscribers see a gap in `seq`.
"""

from __future__ import annotations

import time

import trio

from mlxd.kv.kv_events import AllBlocksCleared, encode_batch
from mlxd.runtime.kernel.messages import PublishKvEvents
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.kv_events")

HIGH_WATER_MARK = 100_000


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind on a wildcard or IPC/in-process endpoint, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisherActor:
    def __init__(self, endpoint: str, *, inbox: trio.MemoryReceiveChannel[PublishKvEvents], topic: str = "") -> None:
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._inbox = inbox
        self.stats = {"batches": 0, "events": 0, "send_failures": 0}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUB)
        sock.set_hwm(HIGH_WATER_MARK)
        try:
            if should_bind(self.endpoint):
                sock.bind(self.endpoint)
            else:
                sock.connect(self.endpoint)
            log.info("kv_events.publishing", endpoint=self.endpoint, bind=should_bind(self.endpoint))
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

        payload = encode_batch(batch.ts, batch.events)
        try:
            sock.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.stats["send_failures"] += 1  # past the high-water mark: dropped, seq still advances
        self.stats["batches"] += 1
        self.stats["events"] += len(batch.events)
        return seq + 1
