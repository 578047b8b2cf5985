"""A trace of the scheduler's steps (the worker's ``--trace-steps FILE``): one JSON line per step.

Why: a served run's time to first token depends on which requests share a step. Closed-loop clients settle
into waves that land in different steps, and a request arriving just after a long extend step began waits
for all of it (docs/benchmarks.md, 2026-12-06). The step-time histogram of /metrics cannot show that order;
this trace does, step by step, next to the worker's request log lines.

A line (times in seconds since the epoch and milliseconds)::

    {"step": 812, "t": 1765043520.184113, "ms": 67.41, "mode": "extend", "extends": 3, "extend_tokens": 192,
     "prefix_tokens": 1536, "decodes": 4, "queued_ms": [74.1, 52.9, 51.6], "first_tokens": 3, "finished": 0,
     "running": 7, "waiting": 1}

``extends`` requests computed ``extend_tokens`` prompt tokens (new prompts, chunks of one, recomputes of
retracted ones) after ``prefix_tokens`` tokens of theirs already in the KV cache (prefix cache hits and
earlier chunks); ``decodes`` requests made one token each (riders of a mixed step, or a decode step);
``queued_ms`` is, for each request admitted here for the first time, how long it waited from its arrival
(a request's TTFT is that, its first-token step's ``ms`` for a prompt in one piece, and the hand-off);
``first_tokens`` requests got their first token; ``running`` and ``waiting`` are the queues after the step.
Steps that ran no forward (only aborts) are left out.

Written on the engine thread, a line at a time (line-buffered: a reader sees every finished step, also while
the worker idles; one small write a step, against steps of a millisecond or more).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO


@dataclass(frozen=True)
class StepShape:
    """What one forward computed (the scheduler's ``last_step``)."""

    mode: str  # "extend" or "decode"
    extends: int
    extend_tokens: int
    prefix_tokens: int
    decodes: int
    queued: tuple[float, ...] = ()  # seconds from arrival to this step, of requests admitted for the first time


@dataclass(frozen=True)
class StepRecord:
    """One line of the trace: the step's shape, its time and what it left behind."""

    step: int
    started_unix: float
    seconds: float
    shape: StepShape
    first_tokens: int
    finished: int
    running: int
    waiting: int

    def to_json(self) -> str:
        s = self.shape
        return json.dumps({
            "step": self.step, "t": round(self.started_unix, 6), "ms": round(self.seconds * 1e3, 3),
            "mode": s.mode, "extends": s.extends, "extend_tokens": s.extend_tokens, "prefix_tokens": s.prefix_tokens,
            "decodes": s.decodes, "queued_ms": [round(q * 1e3, 3) for q in s.queued],
            "first_tokens": self.first_tokens, "finished": self.finished, "running": self.running,
            "waiting": self.waiting,
        })


class StepTrace(Protocol):
    """Where the engine loop puts a step's record (engine thread)."""

    def write(self, record: StepRecord) -> None: ...


class StepTraceFile:
    """JSON lines to ``path`` (truncated at open). Engine thread only, apart from ``close``, which the
    owner calls once the engine loop has stopped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file: TextIO | None = self.path.open("w", encoding="utf-8", buffering=1)
        except OSError as exc:
            raise ValueError(f"--trace-steps: cannot write {path}: {exc.strerror}") from None

    def write(self, record: StepRecord) -> None:
        if self._file is None:
            return
        self._file.write(record.to_json() + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
