"""The worker process's native-heap policy (review F12: worker RSS grew with traffic and stayed up).

Cause: every engine step allocates large temporary tensors whose sizes change from step to step
with the batch (attention scores and masks of a long extend, gathered K/V, logits). glibc serves an
allocation above its mmap threshold (128 KiB at start) with mmap and returns it to the kernel on
free, but each such free *raises* the threshold to that size (up to 32 MiB). From then on those
temporaries come from the brk heap and the per-thread arenas, where blocks of ever-changing sizes
fragment and are kept. RSS climbs with the variety of shapes seen and levels off late; Python
objects stay flat (tracemalloc shows nothing). A bare engine fed identical batches reuses the same
blocks, which is why it looked flat in the review.

Measured in one process (tiny model, WorkerServer on loopback, 64 concurrent streams of 64 new
tokens after prompts of 8-1900 tokens): RSS 357 -> 419 -> 424 MB over 25 rounds with glibc's
self-raising threshold (a plateau: a high-water mark, not a leak); with the threshold fixed at 4 MiB
357 -> 389 MB, at 1 MiB 357 -> 386 MB, at 64 KiB 357 -> 380 MB. Uniform 64x64-token rounds stay at
354-380 MB either way. The price of a fixed threshold is an mmap, page faults on fresh zero pages
and an munmap per large temporary: system CPU 8-10 s -> 32-38 s per 10 rounds of that traffic
(user time unchanged), about 40% more wall time on the tiny model. So the worker keeps glibc's
behaviour by default (``--malloc-mmap-threshold 0``) and an operator who prefers a flat RSS to
throughput sets a threshold.

Fixing the threshold with ``mallopt(M_MMAP_THRESHOLD, n)`` also turns the dynamic adjustment off,
so temporaries above ``n`` are always mmapped and given back.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_MMAP_THRESHOLD = -3  # glibc malloc.h
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's HEAP_MAX / 2 on 64-bit: mallopt refuses more

def fix_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process. Returns False where the C library
    has no ``mallopt`` (not glibc) or the value is outside (0, 32 MiB]."""
    if not 0 < nbytes <= MAX_MMAP_THRESHOLD:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, nbytes) == 1
