"""--compute-nice (worker_svc/executor/compute_priority.py): the step thread and the OpenMP team it
starts run at the nice value; the process's other threads keep theirs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from worker_svc.config.engine_config import EngineConfig

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@pytest.mark.parametrize("bad", [-1, 20])
def test_compute_nice_out_of_range_is_refused(tiny_model, bad: int) -> None:
    with pytest.raises(ValueError, match="--compute-nice must be in 0..19"):
        EngineConfig(model_path=str(tiny_model), compute_nice=bad)


@linux_only
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="an OpenMP team needs two cores here")
def test_the_openmp_team_inherits_the_step_threads_nice() -> None:
    # A process of its own: the tests' process runs one intra-op thread, and its teams would outlive the test.
    script = textwrap.dedent("""
        import os, threading, torch
        from worker_svc.executor.compute_priority import lower_compute_priority
        def nices():
            return sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))
        def step():
            lower_compute_priority(7)
            torch.set_num_threads(2)
            torch.ones(1 << 22).exp().sum()  # a parallel region: this thread's team starts now
            print(nices())
        torch.ones(1 << 22).exp().sum()  # the main thread's team, at the process's nice
        t = threading.Thread(target=step); t.start(); t.join()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    nices = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own script's list of ints
    assert nices.count(7) >= 2, nices  # the step thread and its team
    assert nices.count(0) >= 2, nices  # the main thread and its team are untouched


@linux_only
def test_engine_loop_runs_its_steps_at_compute_nice(tiny_model) -> None:
    from worker_svc.engine.engine import Engine
    from worker_svc.engine.engine_loop import EngineLoop
    from worker_svc.sampling import SamplingParams

    engine = Engine(EngineConfig(model_path=str(tiny_model), dtype="float32", max_total_tokens=256,
                                 max_running_requests=2, context_length=128, compute_nice=5))
    loop = EngineLoop(engine)
    loop.start()
    done = threading.Event()
    try:
        loop.submit([3, 4, 5], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True), "a",
                    lambda item: getattr(item, "finished", True) and done.set())
        assert done.wait(30)
        step_thread = next(t for t in threading.enumerate() if t.name == "engine-loop")
        assert step_thread.native_id is not None
        assert _nice(step_thread.native_id) == 5
        assert _nice(threading.get_native_id()) == 0  # the caller's thread (a gRPC loop's, in a worker)
    finally:
        loop.stop()
