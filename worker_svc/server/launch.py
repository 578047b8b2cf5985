"""Starting the ranks of a serving tensor-parallel group (the leader, tp_leader.py; followers,
tp_follower.py): the single-machine leader's follower processes, how the group's heartbeat secret
reaches every rank, and each rank's device.

Group secret: the heartbeat handshake proves that a peer holds it (worker_svc/parallel/heartbeat.py).
In single-machine mode the leader makes a random one and hands it to the followers it starts through an
inherited pipe (not argv, not the environment: neither ``ps`` nor /proc shows it). With one process per
rank every rank reads it from ``--tp-secret-file``; without one the leader makes it and publishes it
under ``SECRET_KEY`` in the rendezvous store, which only keeps out peers that cannot reach the store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, MutableMapping, Sequence

import structlog

from worker_svc.parallel.heartbeat import check_secret

log = structlog.get_logger(__name__)

# Where a leader without --tp-secret-file publishes the secret in the rendezvous store.
SECRET_KEY = "llmserve/heartbeat-secret"
# A single-machine leader hands each follower the secret through an inherited pipe; only the pipe's
# fd number is in the follower's environment (argv and /proc/PID/environ never hold the secret).
SECRET_FD_ENV = "LLMSERVE_TP_SECRET_FD"


def spawn_follower_processes(
    size: int,
    init_addr: str,
    base_argv: Sequence[str],
    secret: bytes,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    metrics_port: int = 0,
) -> list[subprocess.Popen]:
    """Single-machine mode: start ranks 1..size-1 as ``llmserve worker`` child processes (health on an
    OS-chosen port). ``base_argv`` is the engine and logging flags every rank shares; ``secret`` goes
    through a pipe each child inherits (SECRET_FD_ENV names its fd), never argv or the environment.
    ``env``/``preexec_fn``: the launcher's (e.g. a parent-death signal, so no follower outlives this
    process). ``metrics_port`` P > 0 (the leader's own --metrics-port): rank r serves /metrics on P + r."""
    children = []
    try:
        for rank in range(1, size):
            cmd = [
                sys.executable,
                "-m",
                "llmserve.cli",
                "worker",
                *base_argv,
                "--tp-size",
                str(size),
                "--tp-rank",
                str(rank),
                "--dist-init-addr",
                init_addr,
                "--host",
                host,
                "--port",
                "0",
                *(["--metrics-port", str(metrics_port + rank)] if metrics_port else []),
            ]
            read_end, write_end = os.pipe()
            try:
                os.write(write_end, secret)  # 32 bytes: far below the pipe's buffer, never blocks
                os.close(write_end)
                child_env = {**(os.environ if env is None else env), SECRET_FD_ENV: str(read_end)}
                children.append(subprocess.Popen(cmd, env=child_env, pass_fds=(read_end,), preexec_fn=preexec_fn))
            finally:
                os.close(read_end)
    except BaseException:
        for child in children:
            child.kill()
            child.wait()
        raise
    log.info("tp followers started", pids=[c.pid for c in children], init_addr=init_addr)
    return children


def inherited_secret(environ: MutableMapping[str, str]) -> bytes | None:
    """In a follower that ``spawn_follower_processes`` started: the secret from the leader's pipe (the
    environment entry is removed once read). None in any other process; ValueError when the pipe cannot
    be read or holds no valid secret."""
    inherited = environ.pop(SECRET_FD_ENV, None)
    if inherited is None:
        return None
    try:
        with os.fdopen(int(inherited), "rb") as pipe:
            return check_secret(pipe.read())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the tp group secret from the leader's pipe ({SECRET_FD_ENV}): {exc}") from None
