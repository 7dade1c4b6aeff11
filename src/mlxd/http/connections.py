"""Connections: hypercorn's trio worker with a cap on open connections, and keep-alive that closes.

Two things a plain quart-trio app on hypercorn gets wrong, handled here:

- quart-trio cancels a request's task as soon as hypercorn reports the stream
  closed, which happens *inside* the response's last `send`: the rest of that
  send (starting the keep-alive timer, or closing a `Connection: close` or
  413 connection) is cancelled, so such a connection stays open for good.
  `ShieldedSendConnection` finishes every send. And a connection the client
  closed stayed open until its keep-alive timer ran out (`_TCPServer`).
- hypercorn accepts connections until the process runs out of file handles
  and then answers nothing. `serve` counts open connections and answers a
  connection past `max_connections` with a 503 and closes it.
"""

from __future__ import annotations

import json
import resource
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr
from quart_trio.asgi import TrioASGIHTTPConnection

from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.http")

# Seconds a refused connection may take to send its request head and read the 503.
REFUSE_S = 2.0
# Refusals in progress at once; past this a refused connection is closed without a reply.
MAX_REFUSING = 64
# Largest request head read before answering a refused connection.
HEAD_BYTES = 64 * 1024


def default_max_connections(soft_limit: int | None = None) -> int:
    """Half the process's file-handle limit (the rest is for model, cache and log files), at most 4096."""
    if soft_limit is None:
        soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit == resource.RLIM_INFINITY or soft_limit <= 0:
        soft_limit = 65536
    return max(16, min(4096, soft_limit // 2))


class ShieldedSendConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection whose sends to hypercorn always finish (see the module doc)."""

    async def __call__(self, receive: Any, send: Any) -> None:
        async def send_shielded(message: Any) -> None:
            # hypercorn shields its own socket writes; this covers the bookkeeping after them.
            with trio.CancelScope(shield=True):
                await send(message)

        await super().__call__(receive, send_shielded)


class _TCPServer(TCPServer):
    """hypercorn's connection, ended as soon as the client has closed its side."""

    async def _read_data(self) -> None:
        await super()._read_data()
        # The client is gone: without this the keep-alive timer would hold the connection open.
        await self.idle_task.stop()


def overloaded_response(limit: int) -> bytes:
    """The 503 a connection past the cap gets, as raw HTTP/1.1 (OpenAI-style error body)."""
    body = json.dumps(
        {
            "error": {
                "message": f"the server has {limit} connections open (--max-connections); retry shortly",
                "type": "server_overloaded",
                "param": None,
                "code": None,
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "retry-after: 1\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


@attrs.define
class ConnectionGate:
    """Open connections against the cap; counts what it refused."""

    limit: int
    open: int = 0
    refusing: int = 0
    refused: int = 0

    def stats(self) -> dict[str, int]:
        return {
            "http_connections_open": self.open,
            "http_connections_max": self.limit,
            "http_connections_refused": self.refused,
        }


async def _refuse(stream: trio.abc.Stream, reply: bytes) -> None:
    """Read the request head, answer 503, and close once the client has read it (bounded in time)."""
    with trio.move_on_after(REFUSE_S):
        try:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < HEAD_BYTES:
                data = await stream.receive_some(HEAD_BYTES)
                if not data:
                    break
                head += data
            await stream.send_all(reply)
            await stream.send_eof()  # type: ignore[attr-defined]
            # Closing with unread bytes would reset the connection before the client reads the reply.
            while await stream.receive_some(HEAD_BYTES):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    with trio.CancelScope(shield=True):
        await stream.aclose()


def _handler(
    app: ASGIWrapper,
    config: Config,
    context: WorkerContext,
    state: dict[str, Any],
    gate: ConnectionGate,
) -> Callable[[trio.SocketStream], Awaitable[None]]:
    reply = overloaded_response(gate.limit)

    async def handle(stream: trio.SocketStream) -> None:
        if gate.open >= gate.limit:
            gate.refused += 1
            if gate.refused == 1 or gate.refused % 1000 == 0:
                log.warning(
                    "http.connections_full",
                    limit=gate.limit,
                    refused=gate.refused,
                    note="connections past --max-connections get a 503",
                )
            if gate.refusing >= MAX_REFUSING:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
                return
            gate.refusing += 1
            try:
                await _refuse(stream, reply)
            finally:
                gate.refusing -= 1
            return
        gate.open += 1
        try:
            await _TCPServer(app, config, context, ConnectionState(state.copy()), stream)  # type: ignore[arg-type]
        finally:
            gate.open -= 1

    return handle


class CannotListen(Exception):
    """The address to serve on cannot be bound (in use, not this host's, a privileged port)."""


async def serve(
    app: Any,
    config: Config,
    *,
    gate: ConnectionGate,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn's trio worker (plain HTTP, no QUIC), every connection counted against `gate`."""
    config.set_statsd_logger_class(StatsdLogger)
    wrapped = ASGIWrapper(app)
    state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, config, state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            try:
                sockets = config.create_sockets()
            except OSError as exc:
                raise CannotListen(f"cannot listen on {', '.join(config.bind)}: {exc.strerror or exc}") from exc
            listeners = []
            binds = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            task_status.started(binds)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    handler = _handler(wrapped, config, context, state, gate)
                    nursery.start_soon(
                        partial(
                            trio.serve_listeners, handler, listeners, handler_nursery=server_nursery
                        )
                    )
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, other = error.split(ShutdownError)
                if other is not None:
                    raise other from None
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
