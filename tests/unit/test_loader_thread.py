"""The worker loads its model in a thread that exits afterwards (worker_svc/server/loader_thread.py): the
OpenMP team that thread's parallel regions made goes with it, so while serving the engine thread is the only
thread with one (two teams on a 2-CPU host made every decode step's parallel regions wake sleeping workers:
1.5x slower steps). Threads are counted in /proc/self/task; the contrast (a thread that stays, as
``asyncio.to_thread``'s executor does) shows the count can tell."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from pathlib import Path

import pytest
import torch

from worker_svc.server.loader_thread import run_in_own_thread

TASKS = Path("/proc/self/task")
pytestmark = pytest.mark.skipif(not TASKS.exists(), reason="counts threads in /proc/self/task (Linux)")


def _threads() -> int:
    return len(os.listdir(TASKS))


def _parallel_work() -> float:
    """A loader's kind of work: a parallel region on two OpenMP threads."""
    torch.set_num_threads(2)  # per thread in OpenMP: this thread's regions run two threads
    x = torch.randn(1 << 21)
    return float((x * 2).sum())


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_loaders_openmp_team_exits_with_it(two_threads) -> None:
    async def load() -> float:
        return await run_in_own_thread(_parallel_work)

    idle = _threads()
    assert isinstance(asyncio.run(load()), float)
    assert _threads() == idle
    # A thread that stays keeps its team: itself and at least one OpenMP worker beyond the idle count.
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        executor.submit(_parallel_work).result()
        assert _threads() >= idle + 2
    assert _threads() == idle


def test_what_the_loader_raises_reaches_the_caller() -> None:
    def broken() -> None:
        raise ValueError("bad checkpoint")

    async def load() -> None:
        await run_in_own_thread(broken)

    with pytest.raises(ValueError, match="bad checkpoint"):
        asyncio.run(load())
