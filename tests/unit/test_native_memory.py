"""The worker's native-heap policies (worker_svc/executor/native_memory.py), observed in a fresh process
(mallopt changes the whole process): page faults while a large temporary is freed and allocated again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from worker_svc.executor.native_memory import MAX_MMAP_THRESHOLD, parse_heap_policy

_ROUNDS = 20
_BLOCK = 8 << 20  # a prefill step's activation: above glibc's start threshold, below 32 MiB

_CHILD = f"""
import resource, sys
from worker_svc.executor.native_memory import apply_heap_policy, parse_heap_policy
assert apply_heap_policy(parse_heap_policy(sys.argv[1]))
def step():  # two temporaries of a step, zero-filled: every page touched
    first, second = bytearray({_BLOCK}), bytearray({_BLOCK})
    del second, first
step()  # the first step faults its pages in under every policy
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({_ROUNDS}):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_per_round(policy: str) -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD, policy], capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip()) / _ROUNDS


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_keep_reuses_freed_temporaries_where_glibc_and_a_threshold_give_them_back() -> None:
    pages = 2 * _BLOCK // 4096  # a step's
    assert _faults_per_round("keep") < 0.05 * pages  # reused from the heap: no fresh pages
    # glibc trims the heap's free top once it passes twice the (raised) threshold: the step's pages go back.
    assert _faults_per_round("glibc") > 0.4 * pages
    assert _faults_per_round("1048576") > 0.9 * pages  # unmapped on free, faulted in again


def test_parse_heap_policy() -> None:
    assert parse_heap_policy("keep") == "keep" and parse_heap_policy("glibc") == "glibc"
    assert parse_heap_policy("4194304") == 4 << 20 and parse_heap_policy(str(MAX_MMAP_THRESHOLD)) == MAX_MMAP_THRESHOLD
    for bad in ("0", "-1", str(MAX_MMAP_THRESHOLD + 1), "trim"):
        with pytest.raises(ValueError):
            parse_heap_policy(bad)
