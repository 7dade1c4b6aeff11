"""Small channel helpers: one-shot replies and channel statistics."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import attrs
import trio

T = TypeVar("T")


class Reply(Generic[T]):
    """A one-shot answer channel for request/reply messages between actors.

    Errors travel as values and are re-raised on the receiving side.
    """

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[Any](1)

    def send(self, value: T) -> None:
        try:
            self._send.send_nowait(("ok", value))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the asker went away

    def fail(self, exc: BaseException) -> None:
        try:
            self._send.send_nowait(("error", exc))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def wait(self) -> T:
        with self._receive:
            kind, value = await self._receive.receive()
        if kind == "error":
            raise value
        return value


@attrs.frozen
class ChannelStats:
    """A JSON-friendly view of ``MemorySendChannel.statistics()``."""

    queued: int
    capacity: float
    waiting_senders: int
    waiting_receivers: int

    @classmethod
    def of(cls, channel: trio.MemorySendChannel[Any] | trio.MemoryReceiveChannel[Any]) -> ChannelStats:
        s = channel.statistics()
        return cls(
            queued=s.current_buffer_used,
            capacity=s.max_buffer_size,
            waiting_senders=s.tasks_waiting_send,
            waiting_receivers=s.tasks_waiting_receive,
        )

    def as_dict(self) -> dict[str, Any]:
        cap = self.capacity if self.capacity != float("inf") else None
        return {
            "queued": self.queued,
            "capacity": cap,
            "waiting_senders": self.waiting_senders,
            "waiting_receivers": self.waiting_receivers,
        }
