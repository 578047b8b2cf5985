"""Stop strings over streamed text.

Text arrives in deltas whose boundaries are wherever the tokens (and the detokenizer) put them, so a
stop string can span several deltas. `StopStringMatcher` holds back the longest tail of the pending
text that could still grow into a stop string and releases it once it cannot:

    pending "Hello wor" + delta "ld. Bye"   with stop "world."
      -> match at 6; emit "Hello " (or "Hello world." with include_stop_str_in_output); finished

    pending "" + delta "abc <"               with stop "<end>"
      -> emit "abc ", hold "<"

Invariants (checked by tests/integration/test_router_units.py): the concatenation of everything
emitted, plus `flush()` when no stop matched, equals the input text; when a stop matched, it equals
the input up to the earliest-ending match (plus the stop string itself when included); nothing that
is part of a matched stop string is ever emitted without include_stop_str_in_output.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    stop: str
    # The text to emit before finishing (what was pending before the match, plus the stop string
    # when it is included in the output).
    text: str


class StopStringMatcher:
    """Incremental stop-string search for one sequence."""

    def __init__(self, stops: Iterable[str], include_stop_str_in_output: bool = False):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.matched: str | None = None

    @property
    def pending(self) -> str:
        """Text held back because it may be the start of a stop string."""
        return self._pending

    def push(self, text: str) -> tuple[str, StopMatch | None]:
        """Feed the next text delta; return (text safe to emit, the match if a stop string completed).

        After a match the matcher is finished: the caller ends the sequence and pushes no more."""
        if self.matched is not None:
            raise RuntimeError("push() after a stop string matched")
        if not self.stops:
            return text, None
        buf = self._pending + text
        match = self._earliest_match(buf)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._pending = ""
            end = start + len(stop) if self.include else start
            return "", StopMatch(stop, buf[:end])
        hold = self._hold_length(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """The sequence ended for another reason: release the held text."""
        out, self._pending = self._pending, ""
        return out

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        """The match that completes first (smallest end), as streaming token by token would see it;
        at equal ends the longer stop string (it started earlier)."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.stops:
            i = buf.find(stop)
            if i < 0:
                continue
            key = (i + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _hold_length(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
