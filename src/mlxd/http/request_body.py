"""A request body kept as the chunks hypercorn hands over, joined once when awaited.

quart's `Body` extends one bytearray per chunk: as a multi-megabyte body (a chat
that re-sends its inline images) grows, the bytearray is moved again and again
(about 0.1 ms a chunk in a busy server process), then copied once more into bytes.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from quart_trio.wrappers.request import TrioBody, TrioRequest
from werkzeug.exceptions import RequestEntityTooLarge


class ChunkedBody(TrioBody):
    """quart-trio's body with the same contract (await it whole, or iterate it once), stored as chunks."""

    def __init__(self, expected_content_length: int | None, max_content_length: int | None) -> None:
        super().__init__(expected_content_length, max_content_length)
        self._chunks: list[bytes] = []
        self._size = 0
        self.first_chunk_at: float | None = None  # perf_counter stamps (http/stages.py)
        self.complete_at: float | None = None

    def append(self, data: bytes) -> None:
        if not data or self._must_raise is not None:
            return
        if self.first_chunk_at is None:
            self.first_chunk_at = time.perf_counter()
        self._chunks.append(data if type(data) is bytes else bytes(data))  # hypercorn's are bytes of their own
        self._size += len(data)
        self._has_data.set()
        if self._max_content_length is not None and self._size > self._max_content_length:
            self._must_raise = RequestEntityTooLarge()
            self.set_complete()

    def set_complete(self) -> None:
        self.complete_at = time.perf_counter()
        super().set_complete()

    def _joined(self) -> bytes:
        """Every chunk as one bytes, kept as the only chunk (awaiting again costs nothing)."""
        if len(self._chunks) != 1:
            self._chunks = [b"".join(self._chunks)]
        return self._chunks[0]

    async def __anext__(self) -> bytes:
        if self._must_raise is not None:
            raise self._must_raise
        if not self._complete.is_set():
            await self._has_data.wait()
        if self._complete.is_set() and not self._chunks:
            raise StopAsyncIteration()
        data = self._joined()
        self.clear()
        self._has_data.clear()
        return data

    def __await__(self) -> Generator[Any, None, Any]:
        if self._must_raise is not None:
            raise self._must_raise
        yield from self._complete.wait().__await__()
        if self._must_raise is not None:
            raise self._must_raise
        return self._joined() if self._chunks else b""

    def clear(self) -> None:
        self._chunks = []
        self._size = 0


class ChunkedBodyRequest(TrioRequest):
    """quart-trio's request with a `ChunkedBody`."""

    body_class = ChunkedBody
