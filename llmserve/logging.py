"""Structured logging for every llmserve process.

`configure_logging(json=True)` in services: one JSON object per line on stderr. Otherwise a readable
console format. structlog loggers and stdlib `logging` (grpc, asyncio ...) go through the same
processors, so library lines are JSON too.

`request_context(request_id)` binds `request_id` in a contextvar for the current task or thread:
every log line emitted inside it, by any module, carries the id. grpc.aio runs each RPC in its own
task, so bindings never leak between concurrent requests.

Prompt text is not logged (only counts and ids; the router's --log-prompts turns it on), and
exception tracebacks are rendered without frame locals, which would carry request contents.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


def configure_logging(json: bool = False, level: str = "info") -> None:
    """Route structlog and stdlib logging to stderr as JSON lines (json=True) or console text."""
    if level.lower() not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose from {', '.join(_LEVELS)}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    # Tracebacks never carry frame locals: they hold request contents (prompt text, token ids).
    if json:
        shared += [structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False))]
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(),
                                                 exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    ))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(_LEVELS[level.lower()])


def get_logger(name: str | None = None, **bindings: Any) -> Any:
    """A structlog logger; usable before configure_logging (structlog's defaults then apply)."""
    return structlog.get_logger(name, **bindings)


@contextmanager
def request_context(request_id: str, **bindings: Any) -> Iterator[None]:
    """Bind request_id (when non-empty) and any other key/values to every log line in the block."""
    if request_id:
        bindings["request_id"] = request_id
    with structlog.contextvars.bound_contextvars(**bindings):
        yield
