"""Open a ModelRunner for an offline command: in this process, or as the leader of a tensor-parallel
group whose followers are spawned here and replay its steps (bench-one-batch, eval-ppl)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.native_memory import HeapPolicy
from worker_svc.parallel.collective_observer import CollectiveObserver

if TYPE_CHECKING:  # the executor (and the model stack) is imported when a runner is opened
    from worker_svc.executor.step_runner import StepRunner


@contextmanager
def open_runner(engine_config: EngineConfig, tp: int = 1, tp_init_addr: str | None = None,
                threads: int | None = None, observer: CollectiveObserver | None = None,
                tp_comm: str = "auto", heap_policy: HeapPolicy = "glibc") -> Iterator[StepRunner]:
    """Yields a ModelRunner (tp == 1) or a LeaderRunner over rank 0 of ``tp`` ranks; stops and joins
    the followers and destroys the group on exit. ``observer`` sees the leader's collectives (a single
    rank has none). ``tp_comm``: --tp-comm (parallel/group.py). ``heap_policy``: the followers'
    native-heap policy (executor/native_memory.py; the caller sets its own)."""
    from worker_svc.executor.model_runner import ModelRunner

    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if tp == 1:
        yield ModelRunner(engine_config)
        return
    from worker_svc.executor.tp_runners import LeaderRunner, join_followers, spawn_followers
    from worker_svc.parallel.group import destroy_tp, free_port, init_tp, rank_device

    addr = tp_init_addr or f"127.0.0.1:{free_port()}"
    followers = spawn_followers(tp, addr, [engine_config], threads=threads, comm=tp_comm, heap_policy=heap_policy)
    group = init_tp(0, tp, addr, engine_config.device, observer=observer, comm=tp_comm)
    leader_failed = False
    try:
        engine_config = dataclasses.replace(engine_config, device=str(rank_device(engine_config.device, 0)))
        runner = LeaderRunner(ModelRunner(engine_config, group), group)
        try:
            yield runner
        finally:
            runner.stop_followers()
    except BaseException:
        leader_failed = True
        raise
    finally:
        destroy_tp(group)
        try:
            join_followers(followers)
        except Exception:
            # A follower that failed too (the same bad config, or the leader leaving the group) must
            # not replace the leader's error, which is the one that says what went wrong.
            if not leader_failed:
                raise
