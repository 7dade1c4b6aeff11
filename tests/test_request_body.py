"""A request body kept as chunks (http/request_body.py): whole, in order, once joined; the
size limit holds for a body with no Content-Length; real HTTP over loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import trio
import trio.lowlevel
from tests.serving import ServerThread, config_for
from werkzeug.exceptions import RequestEntityTooLarge

from mlxd.http.request_body import ChunkedBody

LIMIT = 64 * 1024


async def test_awaited_body_is_every_chunk_in_order_and_joined_once() -> None:
    body = ChunkedBody(None, 1 << 20)
    chunks = [bytes([i]) * (1000 + i) for i in range(40)]
    async with trio.open_nursery() as nursery:

        async def feed() -> None:
            for chunk in chunks:
                body.append(chunk)
                await trio.lowlevel.checkpoint()
            body.append(b"")  # an empty chunk is nothing
            body.set_complete()

        nursery.start_soon(feed)
        whole = await body
    assert whole == b"".join(chunks)
    assert await body is whole  # awaiting again: the same bytes, not joined again
    body.clear()
    assert await body == b""


async def test_iterated_body_yields_what_arrived_and_ends() -> None:
    body = ChunkedBody(None, None)
    body.append(b"ab")
    body.append(bytearray(b"cd"))  # bytes-like chunks are kept as bytes
    got = []
    async with trio.open_nursery() as nursery:

        async def read() -> None:
            async for part in body:
                assert type(part) is bytes
                got.append(part)

        nursery.start_soon(read)
        await trio.sleep(0.01)
        body.append(b"ef")
        await trio.sleep(0.01)
        body.set_complete()
    assert b"".join(got) == b"abcdef" and got[0] == b"abcd"


async def test_a_body_past_the_limit_raises_without_a_content_length() -> None:
    body = ChunkedBody(None, 10)
    body.append(b"x" * 8)
    body.append(b"x" * 8)
    with pytest.raises(RequestEntityTooLarge):
        await body
    body.append(b"more")  # ignored once refused
    early = ChunkedBody(11, 10)  # a declared length past the limit: refused before any byte
    with pytest.raises(RequestEntityTooLarge):
        await early


@pytest.fixture(scope="module")
def small_limit(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, max_body_bytes=LIMIT)) as server:
        yield server


def _in_pieces(data: bytes, size: int) -> Iterator[bytes]:
    for at in range(0, len(data), size):
        yield data[at:at + size]


def test_a_chunked_upload_in_many_pieces_is_read_whole(small_limit):
    # Whitespace pads the JSON to most of the limit; sent without a Content-Length, 1 KiB a piece.
    body = b'{"prompt": "hello there",' + b" " * (LIMIT - 1024) + b'"max_tokens": 2, "temperature": 0}'
    url = small_limit.base_url + "/completions"
    r = httpx.post(url, content=_in_pieces(body, 1024), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    plain = httpx.post(url, json=json.loads(body))
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert r.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_a_chunked_upload_past_the_limit_gets_413(small_limit):
    body = b'{"prompt": "' + b"a" * (2 * LIMIT) + b'"}'
    r = httpx.post(small_limit.base_url + "/completions", content=_in_pieces(body, 4096),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert "exceeds" in r.json()["error"]["message"]
    assert httpx.get(small_limit.base_url.removesuffix("/v1") + "/health").json()["status"] == "ok"
