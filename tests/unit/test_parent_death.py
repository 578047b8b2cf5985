"""F6c: children started through llmserve/parent_death.py die when their parent is killed with
SIGKILL: by the kernel's parent-death signal (Linux) and, without it, by their own parent watch.
Real processes: a middle process starts a sleeping grandchild, the test kills the middle one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.procfs import alive

# The middle process: start a child that sleeps (optionally running watch_parent first, as the
# llmserve CLI does), print its pid, then sleep until killed.
MIDDLE = """
import os, subprocess, sys, time
from llmserve import parent_death
use_prctl, use_watch = sys.argv[1] == "1", sys.argv[2] == "1"
child = "import os, time\\n"
if use_watch:
    child += "from llmserve.parent_death import watch_parent\\nwatch_parent(os.environ)\\n"
child += "print('ready', flush=True)\\ntime.sleep(120)\\n"
env = {**os.environ, **(parent_death.child_env() if use_watch else {})}
proc = subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE, text=True,
                        preexec_fn=parent_death.die_with_parent_preexec() if use_prctl else None)
proc.stdout.readline()
print(proc.pid, flush=True)
time.sleep(120)
"""


def _grandchild_after_kill(use_prctl: bool, use_watch: bool, wait_s: float) -> bool:
    """Start middle -> grandchild, SIGKILL the middle; whether the grandchild is still alive after
    ``wait_s``."""
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, str(int(use_prctl)), str(int(use_watch))],
                              stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        grandchild = int(middle.stdout.readline())
        assert alive(grandchild)
        middle.kill()
        middle.wait(10)
        deadline = time.monotonic() + wait_s
        while alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        survived = alive(grandchild)
    finally:
        if middle.poll() is None:
            middle.kill()
    if survived:
        os.kill(grandchild, signal.SIGKILL)
    return survived


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_parent_death_signal_kills_the_child_with_its_parent():
    assert not _grandchild_after_kill(use_prctl=True, use_watch=False, wait_s=1.0)


def test_parent_watch_kills_the_child_without_the_kernel_signal():
    assert not _grandchild_after_kill(use_prctl=False, use_watch=True, wait_s=3.0)


def test_a_plain_child_is_orphaned():
    """The control: without either mechanism the grandchild outlives its parent (the old behaviour)."""
    assert _grandchild_after_kill(use_prctl=False, use_watch=False, wait_s=1.0)


def test_watch_parent_consumes_its_environment_entry():
    from llmserve.parent_death import PARENT_ENV, watch_parent

    environ = {PARENT_ENV: "not-a-pid", "OTHER": "1"}
    assert not watch_parent(environ)
    assert environ == {"OTHER": "1"}  # removed, so this process's own children do not inherit it
    assert not watch_parent({})
