"""The worker loads its model in a thread that exits afterwards (worker_svc/server/loader_thread.py): the
OpenMP team that thread's parallel regions made goes with it, so while serving the engine thread is the only
thread with one (two teams on a 2-CPU host made every decode step's parallel regions wake sleeping workers:
1.5x slower steps). Threads are counted in /proc/self/task; the contrast (a thread that stays, as
``asyncio.to_thread``'s executor does) shows the count can tell."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker_svc.server.loader_thread import run_in_own_thread

TASKS = Path("/proc/self/task")
pytestmark = pytest.mark.skipif(not TASKS.exists(), reason="counts threads in /proc/self/task (Linux)")

# Run in a fresh interpreter: in the test process other tests' threads come and go.
SCRIPT = """
import asyncio, concurrent.futures, os, time, torch
from worker_svc.server.loader_thread import run_in_own_thread

def threads():
    return len(os.listdir("/proc/self/task"))

def settled(target):  # exiting threads leave /proc/self/task a moment after they are told to go
    deadline = time.monotonic() + 5
    while threads() > target and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

def parallel_work():  # a loader's kind of work: a parallel region on two OpenMP threads (OMP_NUM_THREADS)
    return float((torch.randn(1 << 21) * 2).sum())

async def load():  # counted while the event loop still runs, as a serving worker's does
    await run_in_own_thread(parallel_work)
    return settled(idle)

idle = threads()
after_loader = asyncio.run(load())
with concurrent.futures.ThreadPoolExecutor(1) as executor:  # a thread that stays, as to_thread's does
    executor.submit(parallel_work).result()
    while_kept = threads()
print(idle, after_loader, while_kept, settled(idle))
"""


def test_the_loaders_openmp_team_exits_with_it() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], check=True, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, "OMP_NUM_THREADS": "2"})
    idle, after_loader, while_kept, after_executor = map(int, out.stdout.split())
    assert after_loader == idle
    # The staying thread keeps its team: itself and at least one OpenMP worker beyond the idle count.
    assert while_kept >= idle + 2
    assert after_executor == idle


def test_what_the_loader_raises_reaches_the_caller() -> None:
    def broken() -> None:
        raise ValueError("bad checkpoint")

    async def load() -> None:
        await run_in_own_thread(broken)

    with pytest.raises(ValueError, match="bad checkpoint"):
        asyncio.run(load())
