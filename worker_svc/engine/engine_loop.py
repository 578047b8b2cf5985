"""The engine loop: one thread owns the Engine and drives ``scheduler.step()``.

Other threads (the gRPC server's event loop) only ``submit`` and ``abort``; every ``StepOutput`` is
handed to the sink registered for its request, on the engine thread, so a sink must be cheap and
thread-safe (the server's sinks do ``loop.call_soon_threadsafe(queue.put_nowait, ...)``).

The thread sleeps on a condition variable while the scheduler has nothing to do: no busy spin.
If ``step()`` raises, the engine is in an unknown state: every in-flight request gets an
:class:`EngineUnavailable` in its sink, the loop stops for good and the failure callbacks run (the
server turns its health to NOT_SERVING). Another thread can fail the loop the same way with
:meth:`EngineLoop.fail` (a tensor-parallel leader's heartbeat monitor does, when a follower dies).

``idle_tick`` (with ``idle_interval_s``) runs on the engine thread whenever it has been idle that long:
a tensor-parallel leader sends its followers a keepalive there, so every collective comes within the
process group's timeout and all collectives stay on this one thread.

``before_step`` runs on the engine thread at the start of every step, inside the step's time (so a
slow one counts as a slow step): the worker's ``--debug-step-delay`` test hook sleeps there.

``metrics`` (llmserve/metrics.py, None with metrics off) is updated on the engine thread: the step's
time (and its collectives, from ``collectives``, the TP group's observer) after each step, generated
tokens per step, prompt tokens when a prompt is computed, and the latency histograms once a request
finishes, from its own timestamps. Requests submitted with ``observe=False`` (the idle health probe)
are left out.

``step_trace`` (engine/step_trace.py, the worker's ``--trace-steps``) gets one record per step that ran a
forward: its shape from the scheduler, its time, and the queues it left.

``call_on_engine(fn)`` runs ``fn`` on the engine thread between steps (waking it if idle) and gives its
result in a future; ``add_step_listener(fn)`` runs ``fn`` there after every step and every such call
(the KV event publisher takes the step's cache events so).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from worker_svc.engine.engine import Engine
from worker_svc.engine.request import Request, StepOutput
from worker_svc.engine.step_trace import StepRecord, StepTrace
from worker_svc.executor.compute_priority import lower_compute_priority
from worker_svc.sampling import SamplingParams

if TYPE_CHECKING:
    from llmserve.metrics import WorkerMetrics
    from worker_svc.parallel.collective_observer import StepCollectives

log = structlog.get_logger(__name__)

# What the engine thread hands to a request's sink: a step's output, or the reason the request can
# no longer be served.
Sink = Callable[["StepOutput | EngineUnavailable"], None]

_THROUGHPUT_WINDOW_S = 10.0
T = TypeVar("T")


class EngineUnavailable(RuntimeError):
    """The engine cannot take or finish requests: stopped, stopping or failed (gRPC UNAVAILABLE)."""


class LoopState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"  # no new requests; in-flight ones finish or are aborted
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True)
class LoadSnapshot:
    """The engine's load as of its last step (exact while idle)."""

    running: int
    waiting: int
    in_flight: int  # requests submitted and not yet finished, including ones not yet scheduled
    waiting_prompt_tokens: int
    used_tokens: int
    free_tokens: int
    total_tokens: int
    max_running_requests: int
    gen_throughput: float  # generated tokens per second over the last few seconds
    retracted_waiting: int  # waiting requests that were retracted and await recompute
    cached_tokens: int = 0  # held by the radix prefix cache
    cache_hit_rate: float = 0.0  # prompt tokens found in the prefix cache / prompt tokens admitted

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.total_tokens if self.total_tokens else 0.0


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        name: str = "engine-loop",
        idle_tick: Callable[[], None] | None = None,
        idle_interval_s: float = 5.0,
        before_step: Callable[[], None] | None = None,
        metrics: WorkerMetrics | None = None,
        collectives: StepCollectives | None = None,
        step_trace: StepTrace | None = None,
    ) -> None:
        self.engine = engine
        self._step_trace = step_trace
        self._metrics = metrics
        self._collectives = collectives if metrics is not None else None
        self._observed: dict[str, Request] = {}  # requests in flight that the metrics follow
        self._idle_tick = idle_tick
        self._before_step = before_step
        self._idle_interval_s = idle_interval_s
        self.scheduler = engine.scheduler
        self._cv = threading.Condition()
        self._sinks: dict[str, Sink] = {}
        self._state = LoopState.CREATED
        self._stop_requested = False
        self._failure_callbacks: list[Callable[[BaseException], None]] = []
        self._engine_calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._step_listeners: list[Callable[[], None]] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._generated: deque[tuple[float, int]] = deque()
        self.step_count = 0
        self.step_started_at: float | None = None  # monotonic; set while a step runs
        self.last_step_end: float | None = None
        # When work last arrived at an idle engine: progress is measured from there or from the
        # last completed step, whichever is later (see stalled_for).
        self._work_since = time.monotonic()
        self._load = self._snapshot()
        if metrics is not None:
            metrics.watch_load(self.load)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        with self._cv:
            if self._state is not LoopState.CREATED:
                raise RuntimeError(f"engine loop already {self._state.value}")
            self._state = LoopState.RUNNING
        self._thread.start()
        log.info("engine loop started")

    @property
    def state(self) -> LoopState:
        return self._state

    @property
    def healthy(self) -> bool:
        return self._state is LoopState.RUNNING and self._thread.is_alive()

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    def fail(self, exc: BaseException) -> None:
        """Fail the loop from any thread: in-flight requests get EngineUnavailable, the failure
        callbacks run, the engine thread exits after its current step. Idempotent."""
        self._fail(exc)
        with self._cv:
            self._cv.notify_all()

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Run ``callback(exc)`` (on the engine thread) if a step raises."""
        self._failure_callbacks.append(callback)

    def close_admission(self) -> None:
        """Refuse new requests from now on; in-flight ones carry on."""
        with self._cv:
            if self._state is LoopState.RUNNING:
                self._state = LoopState.STOPPING

    def stop(self, abort_in_flight: bool = True, timeout: float | None = 30.0) -> bool:
        """Stop accepting, abort (or let finish) what is in flight, and join the thread.

        Returns True when the thread has exited."""
        self.close_admission()
        with self._cv:
            if abort_in_flight:
                for rid in list(self._sinks):
                    self.scheduler.abort(rid)
            self._stop_requested = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        alive = self._thread.is_alive()
        if not alive and self._state is LoopState.STOPPING:
            self._state = LoopState.STOPPED
        log.info("engine loop stopped" if not alive else "engine loop did not stop in time", timeout=timeout)
        return not alive

    # ---- API for other threads -------------------------------------------------------------------

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError (naming the field) if the engine can never serve this request."""
        self.scheduler.validate(prompt_ids, params)

    def submit(self, prompt_ids: list[int], params: SamplingParams, rid: str, sink: Sink,
               observe: bool = True) -> Request:
        """Queue a request; its outputs go to ``sink`` on the engine thread. ``observe=False``: not in
        the metrics (the worker's own health probe).

        Raises RequestError for a request the engine can never serve and EngineUnavailable when the
        loop does not take requests (stopping, stopped or failed)."""
        request = self.engine.new_request(prompt_ids, params, rid)
        with self._cv:
            if self._state is not LoopState.RUNNING:
                raise EngineUnavailable(f"engine is {self._state.value}")
            if rid in self._sinks:
                raise ValueError(f"request id {rid!r} is already in flight")
            idle = not self._sinks
            self.scheduler.submit(request)  # validates; raises RequestError
            if idle:
                self._work_since = time.monotonic()
            self._sinks[rid] = sink
            if observe and self._metrics is not None:
                self._observed[rid] = request
            self._cv.notify()
        return request

    def abort(self, rid: str) -> bool:
        """Ask the engine to abort ``rid``; its sink then gets a finished output (reason abort).
        Returns False when no such request is in flight."""
        with self._cv:
            if rid not in self._sinks:
                return False
            self.scheduler.abort(rid)
            self._cv.notify()
        return True

    def flush_cache(self) -> Future[tuple[bool, str]]:
        """Ask the engine thread to empty the radix prefix cache between steps; the future gets
        (success, message): refused while requests run or wait. Raises EngineUnavailable when the loop
        does not run (nothing would answer)."""
        with self._cv:
            if self._state is not LoopState.RUNNING:
                raise EngineUnavailable(f"engine is {self._state.value}")
            future = self.scheduler.request_flush()
            self._cv.notify()
        return future

    def call_on_engine(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread before its next step (at once if idle); the future gets its
        result or exception. Raises EngineUnavailable when the loop does not run."""
        future: Future[T] = Future()
        with self._cv:
            if self._state is not LoopState.RUNNING:
                raise EngineUnavailable(f"engine is {self._state.value}")
            self._engine_calls.append((fn, future))
            self._cv.notify()
        return future

    def add_step_listener(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread after every step and every ``call_on_engine`` (cheap)."""
        self._step_listeners.append(fn)

    def in_flight(self) -> list[str]:
        with self._cv:
            return list(self._sinks)

    def in_flight_count(self) -> int:
        """Requests submitted and not yet finished (running or waiting)."""
        with self._cv:
            return len(self._sinks)

    def stalled_for(self) -> float | None:
        """Seconds since the engine last made progress while it has work: since its last completed
        step, or since work arrived at an idle engine if that is later. None while idle. A step
        that runs long, or an engine thread stuck outside a step, both count."""
        if not self.busy():
            return None
        since = max(self.last_step_end or 0.0, self._work_since)
        return max(0.0, time.monotonic() - since)

    def load(self) -> LoadSnapshot:
        with self._cv:
            snap, in_flight = self._load, len(self._sinks)
            throughput = self._throughput(time.monotonic())
        return dataclasses.replace(snap, in_flight=in_flight, gen_throughput=throughput)

    def busy(self) -> bool:
        """Requests are in flight or a step runs. The scheduler alone looks idle while the first
        forward of a newly admitted request runs (it is in neither queue then). Reads without the
        lock on purpose: a health check must answer even if the engine thread is stuck holding it."""
        return bool(self._sinks) or self.step_started_at is not None or self.scheduler.has_work()

    # ---- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        lower_compute_priority(self.engine.config.compute_nice)  # before this thread's first forward
        last_activity = time.monotonic()
        try:
            while True:
                tick = False
                with self._cv:
                    while not self.scheduler.has_work() and not self._stop_requested and not self._engine_calls:
                        if self._state is LoopState.FAILED:
                            return
                        if self._idle_tick is None:
                            self._cv.wait()
                            continue
                        left = last_activity + self._idle_interval_s - time.monotonic()
                        if left <= 0:
                            tick = True
                            break
                        self._cv.wait(left)
                    if self._state is LoopState.FAILED:
                        return
                    calls, self._engine_calls = self._engine_calls, []
                    if not tick and not calls and not self.scheduler.has_work():
                        break  # stop requested and nothing left
                if calls:
                    self._run_calls(calls)
                    if not self.scheduler.has_work():
                        continue
                if tick and self._idle_tick is not None:  # tick is only set when there is one
                    self._idle_tick()
                    last_activity = time.monotonic()
                    continue
                started = self.step_started_at = time.monotonic()
                started_unix = time.time() if self._step_trace is not None else 0.0
                if self._collectives is not None:
                    self._collectives.take()  # keepalives and loading are no step's
                if self._before_step is not None:
                    self._before_step()
                outputs = self.scheduler.step()
                self.last_step_end = last_activity = time.monotonic()
                self.step_started_at = None
                self.step_count += 1
                if self._state is LoopState.FAILED:  # failed from another thread during the step
                    return
                if self._metrics is not None:
                    self._observe(outputs, started, self.last_step_end)
                self._dispatch(outputs)
                if self._step_trace is not None:
                    self._trace(self._step_trace, outputs, started_unix, self.last_step_end - started)
                self._after_step()
        except BaseException as exc:  # noqa: BLE001 - any escape leaves the engine in an unknown state
            self.step_started_at = None
            self._fail(exc)
            return
        with self._cv:
            self._state = LoopState.STOPPED
            leftover, self._sinks = self._sinks, {}
        for rid, sink in leftover.items():  # cannot happen while the scheduler drains; be safe
            self._deliver(rid, sink, EngineUnavailable("engine stopped"))
        self._refuse_calls("engine stopped")

    def _run_calls(self, calls: list[tuple[Callable[[], Any], Future[Any]]]) -> None:
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine carries on
                future.set_exception(exc)
        self._after_step()

    def _after_step(self) -> None:
        for listener in self._step_listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - a broken listener must not take the engine down
                log.exception("engine step listener failed")

    def _refuse_calls(self, why: str) -> None:
        with self._cv:
            calls, self._engine_calls = self._engine_calls, []
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineUnavailable(why))

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        generated = sum(len(out.new_token_ids) for out in outputs)
        deliveries = []
        with self._cv:
            if generated:
                self._generated.append((time.monotonic(), generated))
            for out in outputs:
                sink = self._sinks.pop(out.rid, None) if out.finished else self._sinks.get(out.rid)
                if sink is not None:
                    deliveries.append((out.rid, sink, out))
            self._load = self._snapshot()
        for rid, sink, out in deliveries:
            self._deliver(rid, sink, out)

    def _observe(self, outputs: list[StepOutput], started: float, now: float) -> None:
        """Metrics of one step (engine thread): its time, its collectives, and the requests it served."""
        metrics = self._metrics
        assert metrics is not None
        collectives = self._collectives
        metrics.steps.step(now - started, collectives.take() if collectives is not None else None)
        observed = self._observed
        generated = 0
        for out in outputs:
            req = observed.get(out.rid)
            if req is None:
                continue
            generated += len(out.new_token_ids)
            if out.first_token:  # the prompt is computed
                metrics.prefill_done(out.prompt_tokens, out.cached_tokens)
            if out.finished:
                del observed[out.rid]
                self._request_finished(metrics, req, out, now)
        if generated:
            metrics.requests.generation_tokens.inc(generated)

    def _trace(self, trace: StepTrace, outputs: list[StepOutput], started_unix: float, seconds: float) -> None:
        shape = self.scheduler.last_step
        if shape is None:  # no forward ran
            return
        load = self._load  # the queues after the step (_dispatch took them)
        trace.write(StepRecord(
            step=self.step_count, started_unix=started_unix, seconds=seconds, shape=shape,
            first_tokens=sum(1 for out in outputs if out.first_token),
            finished=sum(1 for out in outputs if out.finished), running=load.running, waiting=load.waiting,
        ))

    @staticmethod
    def _request_finished(metrics: WorkerMetrics, req: Request, out: StepOutput, now: float) -> None:
        first = req.first_token_time
        assert out.finish_reason is not None
        metrics.requests.finished(
            "error" if out.error else out.finish_reason.value,
            e2e_s=now - req.arrival_time,
            ttft_s=first - req.arrival_time if first is not None else None,
            first_to_last_s=now - first if first is not None else None,
            output_tokens=out.completion_tokens,
        )
        if req.scheduled_time is not None:
            metrics.queue_time.observe(req.scheduled_time - req.arrival_time)
        if out.cached_tokens:
            metrics.requests.cached_prompt_tokens.inc(out.cached_tokens)

    @staticmethod
    def _deliver(rid: str, sink: Sink, item: StepOutput | EngineUnavailable) -> None:
        try:
            sink(item)
        except Exception:  # noqa: BLE001 - a broken consumer must not take the engine down
            log.exception("request output sink failed", rid=rid)

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._state is LoopState.FAILED:  # already failed (e.g. from another thread first)
                log.info("engine loop already failed", error=repr(exc))
                return
            log.error("engine failed; failing in-flight requests", error=repr(exc), exc_info=exc)
            self.error = exc
            self._state = LoopState.FAILED
            failed, self._sinks = self._sinks, {}
            self._observed.clear()
        self.scheduler.refuse_flushes(f"engine failed: {exc!r}")
        self._refuse_calls(f"engine failed: {exc!r}")
        for rid, sink in failed.items():
            self._deliver(rid, sink, EngineUnavailable(f"engine failed: {exc!r}"))
        for callback in self._failure_callbacks:
            try:
                callback(exc)
            except Exception:  # noqa: BLE001
                log.exception("engine failure callback failed")

    def _throughput(self, now: float) -> float:
        """Generated tokens per second over the last few seconds (call with ``_cv`` held)."""
        while self._generated and now - self._generated[0][0] > _THROUGHPUT_WINDOW_S:
            self._generated.popleft()
        if not self._generated:
            return 0.0
        return sum(n for _, n in self._generated) / max(now - self._generated[0][0], 1.0)

    def _snapshot(self) -> LoadSnapshot:
        counts = self.scheduler.counts()
        return LoadSnapshot(
            running=counts.running,
            waiting=counts.waiting,
            in_flight=len(self._sinks),
            waiting_prompt_tokens=counts.waiting_prompt_tokens,
            used_tokens=counts.used_tokens,
            free_tokens=counts.free_tokens,
            total_tokens=counts.total_tokens,
            max_running_requests=self.scheduler.engine_config.max_running_requests,
            gen_throughput=0.0,  # computed when read
            retracted_waiting=counts.retracted_waiting,
            cached_tokens=counts.cached_tokens,
            cache_hit_rate=counts.cache_hit_rate,
        )
