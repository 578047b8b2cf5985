"""The Generate calls a worker has in flight, filed under the ids their callers gave them.

A caller's ``request_id`` is a label, never an engine request id. Every sample of every call gets an
engine id minted here, ``<label>#<seq>`` with ``seq`` unique in this process, so two calls that use
the same request_id never share an engine request: not when they run at the same time, and not when
a call is cancelled and at once resubmitted while the engine thread has yet to drop the old one
(that collided and answered UNKNOWN, review F3).

Abort reaches calls by label only (F4):

* ``<request_id>``: every sample of every call in flight under that id;
* ``<request_id>-n<i>`` (calls with n > 1, ``sample_label`` in llmserve/worker_protocol.py): sample ``i``
  of those calls (the router aborts one sample whose stop string matched).

A minted engine id is never a label, so knowing or guessing one reaches nothing. Labels are the
callers' namespace: two callers that pick the same request_id can abort each other's calls. The
router therefore mints a unique id per attempt (keeping the client's id as a log label only), and
with an internal token only the router may call a worker's Generate and Abort.

Every sample ends with exactly one ``generate finished`` log line - with ``finish_reason=abort``
and a ``reason`` (client cancel, deadline, abort rpc, ...) when it was cut short - and an aborted
sample with exactly one ``aborting engine request`` line (F18).

All of it runs on the server's event loop; only the engine loop's ``abort`` crosses threads.
"""

from __future__ import annotations

import itertools
import time

import structlog

from llmserve.worker_protocol import sample_label
from worker_svc.engine.engine_loop import EngineLoop
from worker_svc.engine.request import FinishReason, StepOutput
from worker_svc.server.convert import SampleState

log = structlog.get_logger(__name__)


class GenerateCall:
    """One Generate call: its samples' engine ids and how each of them ended."""

    def __init__(self, request_id: str, engine_ids: list[str], received: float) -> None:
        self.request_id = request_id
        self.states = [SampleState(index=i, rid=rid) for i, rid in enumerate(engine_ids)]
        self.received = received
        self.first_token_at: float | None = None
        self.submitted = 0  # samples handed to the engine so far (in index order)
        self._abort_reasons: dict[int, tuple[str, str | None]] = {}
        self._closed: set[int] = set()  # samples whose "generate finished" line is written

    @property
    def n(self) -> int:
        return len(self.states)

    @property
    def labels(self) -> list[str]:
        if self.n == 1:
            return [self.request_id]
        return [self.request_id, *(sample_label(self.request_id, i) for i in range(self.n))]

    def indices(self, label: str) -> list[int]:
        if label == self.request_id:
            return list(range(self.n))
        return [i for i in range(self.n) if sample_label(self.request_id, i) == label]

    def abort(self, loop: EngineLoop, indices: list[int], reason: str, detail: str | None = None) -> int:
        """Ask the engine to abort these samples (those still running and not yet asked); returns
        how many it was asked to abort."""
        count = 0
        for i in indices:
            st = self.states[i]
            if i >= self.submitted or st.finished or i in self._closed or i in self._abort_reasons:
                continue
            if not loop.abort(st.rid):  # the engine already dropped it (it finished or failed)
                continue
            self._abort_reasons[i] = (reason, detail)
            log.info("aborting engine request", index=i, rid=st.rid, reason=reason, detail=detail)
            count += 1
        return count

    def finished(self, state: SampleState, out: StepOutput, fallback_reason: str) -> None:
        """Log the sample's one "generate finished" line for its final engine output."""
        reason = None
        if out.finish_reason is FinishReason.ABORT:
            reason, detail = self._abort_reasons.get(state.index, (fallback_reason, None))
            if out.error:
                reason, detail = "error", None
        else:
            detail = None
        assert out.finish_reason is not None, "finished() takes a sample's final output"
        self._close(state.index, out.finish_reason.value, out.matched_stop, out.prompt_tokens,
                    out.completion_tokens, reason, detail)

    def end_early(self, loop: EngineLoop, reason: str) -> None:
        """The call is over: abort what still runs, and log an abort line for every sample that has
        none yet. Idempotent."""
        self.abort(loop, list(range(self.n)), reason)
        for st in self.states:
            if st.index in self._closed or st.index >= self.submitted:
                continue
            why, detail = self._abort_reasons.get(st.index, (reason, None))
            last = st.last
            self._close(st.index, FinishReason.ABORT.value, None, last.prompt_tokens if last else None,
                        len(st.output_ids), why, detail)

    def _close(self, index: int, finish_reason: str, matched_stop: int | None, prompt_tokens: int | None,
               completion_tokens: int, reason: str | None, detail: str | None) -> None:
        if index in self._closed:
            return
        self._closed.add(index)
        now = time.monotonic()
        fields = dict(reason=reason, detail=detail) if reason is not None else {}
        log.info(
            "generate finished",
            index=index,
            finish_reason=finish_reason,
            matched_stop=matched_stop,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            duration_s=round(now - self.received, 4),
            ttft_s=round(self.first_token_at - self.received, 4) if self.first_token_at else None,
            **fields,
        )


class CallRegistry:
    """Calls in flight by label, and the engine ids they use (see the module docstring)."""

    def __init__(self) -> None:
        self._by_label: dict[str, list[GenerateCall]] = {}
        self._seq = itertools.count(1)

    def __len__(self) -> int:
        """How many labels have a call in flight (0 once every call has ended)."""
        return len(self._by_label)

    def mint(self, label: str) -> str:
        """An engine request id no other request of this process has or will have."""
        return f"{label}#{next(self._seq)}"

    def open(self, request_id: str, n: int, received: float) -> GenerateCall:
        labels = [request_id] if n == 1 else [sample_label(request_id, i) for i in range(n)]
        call = GenerateCall(request_id, [self.mint(label) for label in labels], received)
        for label in call.labels:
            self._by_label.setdefault(label, []).append(call)
        return call

    def close(self, call: GenerateCall) -> None:
        for label in call.labels:
            calls = self._by_label.get(label)
            if calls is None:
                continue
            if call in calls:
                calls.remove(call)
            if not calls:
                del self._by_label[label]

    def abort(self, loop: EngineLoop, label: str, reason: str, detail: str | None = None) -> int:
        """Abort what runs under ``label``; returns how many engine requests were asked to stop."""
        calls = list(self._by_label.get(label, ()))
        return sum(call.abort(loop, call.indices(label), reason, detail) for call in calls)
