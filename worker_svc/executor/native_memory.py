"""The worker process's native-heap policy: what glibc does with the large temporaries an engine step frees.

Every engine step allocates large temporary tensors (activations of a prefill chunk, attention scores,
gathered K/V, logits) whose sizes change with the batch. glibc's defaults serve an allocation above its
mmap threshold (128 KiB at start) with mmap and unmap it on free, *raising* the threshold to that size
(up to 32 MiB) each time; below it, blocks come from the heap, whose free top is given back to the kernel
once it passes the trim threshold (twice the mmap threshold). Memory given back is faulted in again, a
fresh zeroed page at a time, by the next step that needs it.

Three policies (``llmserve worker --malloc-mmap-threshold``):

- ``keep`` (default): mmap threshold fixed at 32 MiB and the heap never trimmed. A step's temporaries
  reuse the blocks the steps before freed: no page faults in steady state, and RSS levels off at the
  high-water mark of a step's temporaries. Measured on the real model (SmolLM2-135M, a 4 x 128-token
  prefill step, 2-core AMX Xeon, 2026-12-06): glibc's policy took 32-38k page faults and 41-52 ms of
  system time a step (of ~110-160 ms), ``keep`` none; a serving worker took 290-610k faults per 64
  prompts of 128 tokens under glibc's, under 130 with ``keep`` (benchmarks/heap_policy_ab.sh).
- ``glibc``: glibc's self-raising threshold and trimming, as the C library ships.
- a size in bytes (at most 32 MiB, e.g. 4194304): temporaries above it are unmapped on free, so RSS stays
  near idle under traffic of changing shapes (review F12), at the cost of an mmap, page faults and an
  munmap per large temporary (system time 8-10 s -> 32-38 s per 10 rounds of F12's traffic).

``mallopt`` with any of these parameters also turns glibc's dynamic adjustment off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Literal

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's HEAP_MAX / 2 on 64-bit: mallopt refuses more
_NEVER_TRIM = (1 << 31) - 1  # mallopt takes an int

HeapPolicy = Literal["keep", "glibc"] | int


def parse_heap_policy(text: str) -> HeapPolicy:
    """``keep``, ``glibc`` or a threshold in bytes, 1..32 MiB (ValueError otherwise)."""
    if text in ("keep", "glibc"):
        return text  # type: ignore[return-value]
    nbytes = int(text)
    if not 0 < nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"an mmap threshold is 1..{MAX_MMAP_THRESHOLD} bytes, got {nbytes}")
    return nbytes


def apply_heap_policy(policy: HeapPolicy) -> bool:
    """Set this process's policy before the model loads. False where the C library has no ``mallopt``
    (not glibc) or refused a value; ``glibc`` changes nothing and returns True."""
    if policy == "glibc":
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if policy == "keep":
        return mallopt(_M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    return mallopt(_M_MMAP_THRESHOLD, policy) == 1


def _mallopt():  # noqa: ANN202 - a ctypes function
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
