"""The tensor-parallel step runners: the leader's ``LeaderRunner`` broadcasts each step before running
it; a follower's ``FollowerLoop`` receives and runs steps until the leader sends STOP. Also the
``torch.multiprocessing`` follower spawner that bench-one-batch and the unit tests use (the serving
worker starts its followers as processes: worker_svc/server/launch.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.multiprocessing as mp

from worker_svc.config.engine_config import EngineConfig
from worker_svc.config.model_config import ModelConfig
from worker_svc.config.tp_timeouts import TP_UNWATCHED_TIMEOUT_S
from worker_svc.executor.compute_priority import lower_compute_priority
from worker_svc.executor.kernel_choice import KernelPlan
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.executor.native_memory import HeapPolicy, apply_heap_policy
from worker_svc.executor.step_runner import StepRunner
from worker_svc.forward_batch import FatalStepError, StepInput
from worker_svc.kvcache import KVCache
from worker_svc.parallel.context import TPContext
from worker_svc.parallel.group import destroy_tp, init_tp, rank_device
from worker_svc.parallel.step_broadcast import broadcast_keepalive, broadcast_step, receive_step

if TYPE_CHECKING:
    from llmserve.metrics import StepMetrics
    from worker_svc.parallel.collective_observer import StepCollectives

_T = TypeVar("_T")


class FollowerLoop:
    """A follower rank: receive a step, run it, repeat until the leader sends STOP.

    ``metrics`` (None: none) get each step's forward time and the collectives inside it, summed by
    ``collectives`` (the observer of ``tp``); waiting for the leader's next step is neither."""

    def __init__(self, runner: StepRunner, tp: TPContext, metrics: StepMetrics | None = None,
                 collectives: StepCollectives | None = None) -> None:
        if tp.is_leader:
            raise ValueError("rank 0 is the leader, not a follower")
        self.runner = runner
        self.tp = tp
        self.steps = 0
        self._metrics = metrics
        self._collectives = collectives if metrics is not None else None

    def run(self) -> int:
        """Returns the number of steps run."""
        metrics, collectives = self._metrics, self._collectives
        while (step := receive_step(self.tp, self.runner.device)) is not None:
            if metrics is None:
                self.runner.forward(step)
            else:
                if collectives is not None:
                    collectives.take()  # the receive: idle time, not the step's
                started = time.monotonic()
                self.runner.forward(step)
                metrics.step(time.monotonic() - started, collectives.take() if collectives is not None else None)
            self.steps += 1
        return self.steps


class TPGroupFailed(FatalStepError):
    """A tensor-parallel peer died or hung (or a step failed on one rank): the group cannot run steps."""


class LeaderRunner:
    """The leader's ``StepRunner``: ``forward`` broadcasts the step, then runs it on the wrapped runner.

    Everything else the engine reads (configs, device, KV cache, ...) is the wrapped runner's, passed
    through explicitly, so the scheduler and ``StaticBatch`` use it like a ``ModelRunner``.
    """

    def __init__(self, runner: StepRunner, tp: TPContext) -> None:
        if not tp.is_leader:
            raise ValueError("only rank 0 leads")
        self.runner = runner
        self.tp = tp
        self.stopped = False
        self.broken: BaseException | None = None

    @property
    def engine_config(self) -> EngineConfig:
        return self.runner.engine_config

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def context_len(self) -> int:
        return self.runner.context_len

    @property
    def kv(self) -> KVCache:
        return self.runner.kv

    @property
    def weight_nbytes(self) -> int:
        return self.runner.weight_nbytes

    @property
    def kernels(self) -> KernelPlan:
        return self.runner.kernels

    @property
    def torch_compile(self) -> str:
        return self.runner.torch_compile

    @property
    def fused_layers_state(self) -> str:
        return self.runner.fused_layers_state

    def _guarded(self, fn: Callable[[], _T]) -> _T:
        """Any failure here leaves the ranks out of step (a peer is gone, or waits in a collective this
        rank will never join), so it breaks the group for good: TPGroupFailed, now and on every call."""
        if self.stopped:
            raise RuntimeError("the followers were already stopped")
        if self.broken is not None:
            raise TPGroupFailed(f"tensor-parallel group is broken: {self.broken!r}")
        try:
            return fn()
        except Exception as exc:
            self.broken = exc
            raise TPGroupFailed(f"tensor-parallel step failed: {exc}") from exc

    def forward(self, step: StepInput) -> torch.Tensor:
        def run() -> torch.Tensor:
            broadcast_step(self.tp, step)
            return self.runner.forward(step)

        return self._guarded(run)

    def keepalive(self) -> None:
        """An idle tick: a header the followers skip, so no collective waits past the group timeout."""
        self._guarded(lambda: broadcast_keepalive(self.tp))

    def stop_followers(self) -> None:
        """Send STOP once; the followers' loops return."""
        if not self.stopped:
            self.stopped = True
            broadcast_step(self.tp, None)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """``config`` on this rank's device (``cuda`` without an index: one GPU per rank)."""
    device = str(rank_device(config.device, rank))
    return config if device == config.device else dataclasses.replace(config, device=device)


def run_follower(
    rank: int,
    size: int,
    init_addr: str,
    engine_configs: list[EngineConfig],
    threads: int | None = None,
    timeout_s: float | None = None,
    comm: str = "auto",
) -> list[int]:
    """Entry point of a follower process: join the group, then for each ``EngineConfig`` in turn build
    this rank's runner and replay the leader's steps until STOP. Returns the steps run per config."""
    if threads:
        torch.set_num_threads(threads)
    # This thread loads and steps: lowered before its first parallel region, so its OpenMP team is too.
    lower_compute_priority(engine_configs[0].compute_nice)
    tp = init_tp(rank, size, init_addr, engine_configs[0].device, timeout_s or TP_UNWATCHED_TIMEOUT_S, comm=comm)
    steps = []
    try:
        for engine_config in engine_configs:
            steps.append(FollowerLoop(ModelRunner(rank_config(engine_config, rank), tp), tp).run())
    finally:
        destroy_tp(tp)
    return steps


def _spawned_follower(
    index: int, size: int, init_addr: str, engine_configs: list[EngineConfig], threads: int | None,
    timeout_s: float | None, comm: str, heap_policy: HeapPolicy,
) -> None:
    apply_heap_policy(heap_policy)  # before the model loads
    run_follower(index + 1, size, init_addr, engine_configs, threads, timeout_s, comm)


def spawn_followers(
    size: int,
    init_addr: str,
    engine_configs: list[EngineConfig],
    threads: int | None = None,
    timeout_s: float | None = None,
    comm: str = "auto",
    heap_policy: HeapPolicy = "glibc",
) -> mp.ProcessContext:
    """Start ranks 1..size-1 as spawned processes (the caller is rank 0); returns the process context
    (``join()`` it after stopping the followers). ``comm``: --tp-comm (parallel/group.py). ``heap_policy``:
    theirs (native_memory.py)."""
    args = (size, init_addr, engine_configs, threads, timeout_s, comm, heap_policy)
    context = mp.spawn(_spawned_follower, args=args, nprocs=size - 1, join=False)
    assert context is not None  # join=False always returns the context
    return context


def join_followers(context: mp.ProcessContext, timeout_s: float = 60.0) -> None:
    """Wait for spawned followers to exit (re-raising a follower's error); kill them past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"tp followers still running after {timeout_s:.0f} s; killed")
