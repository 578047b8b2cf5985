"""Child processes that die with their parent: `llmserve serve`'s children, a TP leader's followers.

Two layers, both set up by the launcher:

* Linux: ``preexec_fn=die_with_parent_preexec()`` sets ``PR_SET_PDEATHSIG`` (SIGKILL) in the child
  between fork and exec, so the kernel kills the child the moment its parent dies, even by SIGKILL.
  The child then checks that its parent is still the launcher (it may have died before the prctl).
  The kernel's "parent" is the *thread* that forked: launch from a thread that lives as long as the
  process (serve's main thread; the worker's event-loop thread), never from a short-lived one.
* Everywhere: ``child_env()`` names the launcher's pid in the child's environment (PARENT_ENV), and
  ``watch_parent()``, run first thing by the child's CLI, polls ``getppid()`` every
  ``POLL_INTERVAL_S`` and kills the process once the parent is gone (an orphan is re-parented).

SIGKILL, not SIGTERM: a parent that vanished will not wait for a graceful drain, and a draining child
would keep its port (a restarted cluster could not bind it) for --shutdown-grace seconds or more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, MutableMapping

PARENT_ENV = "LLMSERVE_PARENT_PID"
POLL_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return libc.prctl


def die_with_parent_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when this process dies (Linux; ``None``
    elsewhere, where the ``watch_parent`` fallback does the job). Resolved here, in the parent, so
    the child between fork and exec only makes the call."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return preexec


def child_env() -> dict[str, str]:
    """Environment entries that let the child's ``watch_parent`` know its launcher."""
    return {PARENT_ENV: str(os.getpid())}


def watch_parent(environ: MutableMapping[str, str]) -> bool:
    """In a child: if PARENT_ENV names the launcher, exit now when it is already gone, else watch it
    from a daemon thread. The entry is removed, so this process's own children do not inherit it.
    Returns whether a watch was set up."""
    value = environ.pop(PARENT_ENV, None)
    if not value or not value.isdigit():
        return False
    parent = int(value)
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_INTERVAL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return True
