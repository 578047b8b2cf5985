"""Structured logging for every llmserve process.

`configure_logging(json=True)` in services: one JSON object per line on stderr. Otherwise a readable
console format. structlog loggers and stdlib `logging` (grpc, asyncio ...) go through the same
processors, so library lines are JSON too. structlog's own lines skip stdlib logging (it took half of a
line's cost, which every request pays a few times in each service); library lines go through a handler
that writes with the same writer and lock.

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
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


class _NamedWriter(structlog.WriteLogger):
    """structlog's own writer (no stdlib record, handler or formatter on the way: a third of the cost of a
    line), with the name the module asked for, which ``add_logger_name`` reads as it does a stdlib logger's."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


class _WriterHandler(logging.Handler):
    """Library (stdlib) records, formatted by structlog's processors, written through the same writer
    and so under the same per-file lock as structlog's lines: the two never interleave."""

    def __init__(self, file: TextIO) -> None:
        super().__init__()
        self._writer = _NamedWriter(file, "")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._writer.msg(self.format(record))
        except Exception:  # noqa: BLE001 - logging's contract: a failed emit is reported, never raised
            self.handleError(record)


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
    stream = sys.stderr
    writers: dict[str, _NamedWriter] = {}

    def writer(name: str = "", *_: Any) -> _NamedWriter:  # built on every call (loggers are not cached)
        named = writers.get(name)
        if named is None:
            named = writers[name] = _NamedWriter(stream, name)
        return named

    # structlog's lines skip stdlib logging: a level below the threshold is a no-op method, and the rest go
    # straight to the renderer and the stream.
    structlog.configure(
        processors=[*shared, renderer],
        logger_factory=writer,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level.lower()]),
        cache_logger_on_first_use=False,
    )
    handler = _WriterHandler(stream)
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
