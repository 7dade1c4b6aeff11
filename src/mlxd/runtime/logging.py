"""structlog setup: JSON lines off a terminal, pretty console output on one."""

from __future__ import annotations

import logging
import sys

import structlog


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


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
