"""What the chat route lends to the other agent protocols (Anthropic Messages, OpenAI Responses).

Those routes translate their bodies into a chat request and run it through the
very same path as `/v1/chat/completions` (same prompt rendering, same
admission, same prompt cache), then shape the reply their own way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
from quart import Response


def event_stream(events: AsyncIterator[str]) -> Response:
    """A server-sent-events response that streams `events` as they come (no caching, no timeout)."""
    response = Response(events, content_type="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.timeout = None
    return response


@attrs.frozen
class RouteKit:
    """The chat route's steps, as create_app builds them for one app."""

    read_json: Callable[[], Awaitable[Any]]  # the body, or an ApiError (400) for bad JSON
    check_model: Callable[[str | None], None]  # ApiError (404) for a model this server does not serve
    # (parsed, chat messages, options, param) -> (prompt, media, checkpoint cuts): refused early if it
    # cannot fit, rendered by the chat template, images prepared (a 400 names `param`); the cuts: where
    # the template's rendering stops being stable, on caches that cannot be cut back (else ())
    chat_prompt: Callable[..., Awaitable[tuple[tuple[int, ...], tuple[Any, ...], tuple[int, ...]]]]
    # (parsed, prompt, options, *, chat, session, media, checkpoint_at) -> the request's generations (`_Choice`s)
    start_choices: Callable[..., Awaitable[list[Any]]]
    close: Callable[[list[Any]], Awaitable[None]]  # close the generations' streams (shielded)
    # The model a reply names for a request's `model`: the --adapter it chose, else the served model.
    reply_model: Callable[[str | None], str]
