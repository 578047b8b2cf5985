"""The step thread's CPU priority (--compute-nice).

A worker's forward runs on its step thread and the OpenMP team that thread starts. On a host whose cores
it shares with its own gRPC thread, a router, a tokenizer service or clients, every one of those waits
for a core the forward's threads hold: each hop of a request's first token pays a scheduling delay
(docs/benchmarks.md, "the step thread's nice"). Run at a higher nice value, the step threads yield at
once to the short, latency-bound work and take back the cores it leaves idle, so the forward loses
only the CPU that work really uses. Linux keeps a nice value per thread, and a thread it creates
inherits it: set before the step thread's first parallel region, it covers the OpenMP team too (each
thread that starts a parallel region gets a team of its own).
"""

from __future__ import annotations

import os
import sys
import threading

import structlog

log = structlog.get_logger(__name__)


def lower_compute_priority(nice: int) -> None:
    """Run the calling thread, and the threads it starts from now on, at ``nice`` (0: leave it; above 0 as
    EngineConfig.compute_nice allows, 1..19: raising a nice value needs no privilege)."""
    if not nice:
        return
    if not sys.platform.startswith("linux"):  # elsewhere a nice value is the process's, not a thread's
        log.warning("compute_nice needs Linux's per-thread nice values; ignored", compute_nice=nice)
        return
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    log.info("step thread priority lowered", compute_nice=nice)
