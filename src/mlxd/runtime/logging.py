"""Logging: mlxd writes nothing until the program configures logging.

Every mlxd module logs through `get_logger(name)`. Until the program configures
structlog (`configure_logging` below, as the CLI does, or its own
`structlog.configure`), events go to the standard library logger of that name
(`mlxd.*`) as `event key=value ...` lines, and a `NullHandler` on `mlxd` keeps
them silent unless the program sets up `logging` (structlog's own default
would print them to stdout, into the program's output). Once structlog is
configured, mlxd's events follow that configuration.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

logging.getLogger("mlxd").addHandler(logging.NullHandler())


def configure_logging(fmt: str = "auto", *, level: str = "info") -> None:
    """Configure structlog and stdlib logging once for the process (the CLI calls this)."""
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    elif fmt == "console":
        renderer = structlog.dev.ConsoleRenderer()
    else:
        raise ValueError(f"unknown log format {fmt!r} (json, console or auto)")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # hypercorn and quart log through the standard library.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")


def _as_stdlib_call(_logger: Any, _method: str, event_dict: structlog.typing.EventDict) -> Any:
    """The last processor on the stdlib route: one `event key=value` message, exc_info kept for logging."""
    exc_info = event_dict.pop("exc_info", None)
    event = event_dict.pop("event", "")
    rest = _LOGFMT(None, "", event_dict) if event_dict else ""
    return (f"{event} {rest}".rstrip(),), ({"exc_info": exc_info} if exc_info else {})


_LOGFMT = structlog.processors.LogfmtRenderer(bool_as_flag=False)
_STDLIB_PROCESSORS: list[structlog.typing.Processor] = [
    structlog.stdlib.filter_by_level,
    structlog.contextvars.merge_contextvars,
    _as_stdlib_call,
]


class MlxdLogger:
    """mlxd's logger: structlog's configuration when the program made one, else stdlib `logging`.

    Decided at each call, so a module-level logger follows a `configure_logging` made later.
    """

    __slots__ = ("_context", "_name")

    def __init__(self, name: str, context: dict[str, Any] | None = None) -> None:
        self._name = name
        self._context = context or {}

    def _target(self) -> Any:
        if structlog.is_configured():
            return structlog.get_logger(self._name).bind(**self._context)
        return structlog.wrap_logger(
            logging.getLogger(self._name), processors=_STDLIB_PROCESSORS,
            wrapper_class=structlog.stdlib.BoundLogger, **self._context,
        )

    def bind(self, **values: Any) -> MlxdLogger:
        return MlxdLogger(self._name, {**self._context, **values})

    def debug(self, event: str, **kw: Any) -> None:
        self._target().debug(event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._target().info(event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._target().warning(event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._target().error(event, **kw)

    def exception(self, event: str, **kw: Any) -> None:
        self._target().exception(event, **kw)


def get_logger(name: str) -> MlxdLogger:
    """The logger every mlxd module uses (`name` under `mlxd.`): silent until logging is configured."""
    return MlxdLogger(name)
