"""Supervision of `llmserve serve`'s child processes: start, health-wait, restart with backoff, stop.

One policy for every child (the tokenizer, each worker group's rank 0, the router): a child that
exits while the cluster runs, whatever the cause (a crash, kill -9, the OOM killer, a TP leader
whose group broke: worker_svc/server/tp_leader.py exits 1 then), is started again with the same command on
the port it had, since the router's worker list and the clients' router address are fixed. The
restart waits ``backoff_s * 2**k`` seconds (k: the child's restarts within ``window_s``; at most
``max_backoff_s``), so a child that keeps crashing does not spin. A restart is done once the child
answers grpc.health.v1 SERVING; one that exits again, or is not healthy within the startup timeout
(it is then killed), is one more failure. A child that needs more than ``max_restarts`` restarts
within ``window_s`` makes the supervisor give up: the cluster stops and serve exits 1
(``max_restarts`` 0: the first death stops the cluster, as before supervision).

The others keep serving meanwhile: the router marks a dead worker group NOT_SERVING and its probes
bring the group back once it answers again; the router's channels reconnect to a restarted
tokenizer. Initial start-up is stricter: a child that dies or never becomes healthy there stops
everything at once (a bad flag or model fails fast instead of looping).

No child outlives serve (llmserve/parent_death.py): every child gets the kernel's parent-death
signal (Linux) and watches its parent's pid (everywhere). Children run in their own session, so a
terminal's Ctrl-C reaches only serve, which stops them in order (router first). The current pid of
every child is kept in ``pid_file`` (JSON, rewritten at each start) for operators.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmserve import parent_death

TAIL_LINES = 25
PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 300.0

    def __post_init__(self) -> None:
        if not (self.backoff_s >= 0 and self.max_backoff_s >= self.backoff_s and self.window_s > 0):
            raise ValueError(f"bad restart policy {self}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    def delay(self, recent_restarts: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** min(recent_restarts, 30))


class ChildFailed(Exception):
    def __init__(self, child: Child, what: str):
        super().__init__(what)
        self.child = child


@dataclass
class Child:
    """One supervised process. ``cmd`` holds ``--port P``; restarts replace P by the port it reported."""

    name: str
    cmd: list[str]
    log_path: Path
    port_file: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    port: int | None = None
    state: str = "new"  # new -> starting -> running -> backoff -> starting ... ; stopped
    due: float = 0.0  # backoff: when to start again; starting: the health deadline
    restarts: deque[float] = field(default_factory=deque)  # when each restart was scheduled
    failed_at: float = 0.0

    def argv(self) -> list[str]:
        if self.port is None:
            return list(self.cmd)
        cmd = list(self.cmd)
        cmd[cmd.index("--port") + 1] = str(self.port)
        return cmd

    def spawn(self) -> None:
        self.port_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            # Own session: a terminal's Ctrl-C goes to serve alone, which stops children in order.
            self.proc = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, **parent_death.child_env()}, start_new_session=True,
                preexec_fn=parent_death.die_with_parent_preexec())

    @property
    def address_port(self) -> int:
        assert self.port is not None
        return self.port

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, n: int = TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join("    " + line for line in lines[-n:]) or "    (empty log)"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class Supervisor:
    """Starts and watches ``Child`` processes. Call ``poll`` from one long-lived thread (the kernel's
    parent-death signal follows the thread that started a child)."""

    def __init__(
        self,
        policy: RestartPolicy,
        connect_host: str,
        channel: Callable[[str], Any],
        startup_timeout_s: float,
        pid_file: Path | None = None,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.policy = policy
        self.connect_host = connect_host
        self._channel = channel  # address -> a grpc.Channel (plaintext or TLS, with the internal token)
        self.startup_timeout_s = startup_timeout_s
        self.pid_file = pid_file
        self._report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        self.children: list[Child] = []

    # ---- starting ------------------------------------------------------------------------------

    def start(self, child: Child) -> None:
        child.spawn()
        child.state = "starting"
        child.due = time.monotonic() + self.startup_timeout_s
        if child not in self.children:
            self.children.append(child)
        self._write_pids()

    def _healthy(self, child: Child) -> bool:
        """One quick probe: has it reported its port, and does it answer SERVING?"""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if not child.port_file.exists():
            return False
        try:
            port = int(child.port_file.read_text().strip())
        except (OSError, ValueError):  # being written
            return False
        child.port = port
        with self._channel(_join(self.connect_host, port)) as channel:
            try:
                resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                 timeout=PROBE_TIMEOUT_S)
            except grpc.RpcError:
                return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def wait_ready(self, children: Sequence[Child], stop: threading.Event) -> None:
        """Initial start-up: block until every one of ``children`` is SERVING (or ``stop`` is set);
        ChildFailed when one dies or is not healthy by its deadline."""
        pending = list(children)
        while pending and not stop.is_set():
            for child in list(pending):
                code = child.exit_code()
                if code is not None:
                    raise ChildFailed(child, f"{child.name} exited with code {code} during startup")
                if self._healthy(child):
                    child.state = "running"
                    pending.remove(child)
                elif time.monotonic() > child.due:
                    raise ChildFailed(child, f"{child.name} did not become healthy in time")
            if pending:
                stop.wait(0.1)

    # ---- supervising ---------------------------------------------------------------------------

    def poll(self) -> ChildFailed | None:
        """One pass over every child: notice deaths, schedule and run restarts, finish restarts that
        became healthy. Returns the failure that exhausted a child's restarts (give up), else None."""
        now = time.monotonic()
        for child in self.children:
            if child.state in ("running", "starting"):
                code = child.exit_code()
                if code is None and child.state == "starting" and now > child.due:
                    child.kill()
                    code = child.exit_code()
                    why = f"{child.name} did not become healthy within {self.startup_timeout_s:.0f}s of a restart"
                elif code is not None:
                    when = "during a restart" if child.state == "starting" else "unexpectedly"
                    why = f"{child.name} exited with code {code} {when}"
                if code is not None:
                    failure = self._failed(child, why, now)
                    if failure is not None:
                        return failure
                elif child.state == "starting" and self._healthy(child):
                    child.state = "running"
                    self._report(f"llmserve serve: {child.name} is back (pid {child.pid}, port {child.port}) "
                                 f"{time.monotonic() - child.failed_at:.1f}s after it failed")
            elif child.state == "backoff" and now >= child.due:
                self.start(child)
                self._report(f"llmserve serve: restarting {child.name} (pid {child.pid}, port {child.port})")
        return None

    def _failed(self, child: Child, why: str, now: float) -> ChildFailed | None:
        while child.restarts and now - child.restarts[0] > self.policy.window_s:
            child.restarts.popleft()
        tail = f"; last lines of its log ({child.log_path}):\n{child.tail()}"
        if len(child.restarts) >= self.policy.max_restarts:
            if self.policy.max_restarts:
                why += (f"; it was restarted {len(child.restarts)} time(s) in the last "
                        f"{self.policy.window_s:.0f}s (--max-restarts {self.policy.max_restarts}): giving up")
            child.state = "stopped"
            self._report(f"llmserve serve: {why}{tail}")
            return ChildFailed(child, why)
        delay = self.policy.delay(len(child.restarts))
        child.restarts.append(now)
        child.state, child.due, child.failed_at = "backoff", now + delay, now
        self._report(f"llmserve serve: {why}; restarting it on port {child.port} in {delay:.1f}s "
                     f"(restart {len(child.restarts)} of at most {self.policy.max_restarts} "
                     f"in {self.policy.window_s:.0f}s){tail}")
        return None

    def _write_pids(self) -> None:
        if self.pid_file is None:
            return
        pids = {c.name: c.pid for c in self.children if c.pid is not None}
        tmp = self.pid_file.with_name(self.pid_file.name + ".tmp")
        tmp.write_text(json.dumps(pids) + "\n")
        os.replace(tmp, self.pid_file)

    # ---- stopping ------------------------------------------------------------------------------

    def stop(self, groups: Sequence[Sequence[Child]], grace: float) -> None:
        """SIGTERM group by group (router first), waiting for each group; SIGKILL what does not exit.
        Nothing is restarted afterwards."""
        import signal

        for group in groups:
            for child in group:
                child.state = "stopped"
                child.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace + 15.0
            for child in group:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._report(f"llmserve serve: {child.name} did not stop; killing it")
                    child.kill()
