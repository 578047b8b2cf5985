"""F6 and F5 through `llmserve serve` as real processes on 127.0.0.1 (tiny model): a worker group
killed with SIGKILL is restarted on its port while the other group keeps answering; a TP group whose
follower died restarts and serves again; `kill -9 serve` leaves no child (nor TP grandchild) alive;
the TP ranks listen on loopback only and their group secret is in neither argv nor the logs.

Recovery times are printed (run with -s to see them)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import router_pb2 as rpb
from router.client import RouterClient
from tests.procfs import alive, children_of, descendants, is_loopback, listening_sockets

ENGINE_FLAGS = ["--dtype", "float32", "--max-total-tokens", "1024", "--context-length", "256",
                "--max-running-requests", "8"]
STARTUP_S = 180.0  # a worker's start on a busy 2-core machine (torch import + model load)
BACKOFF_S = 0.5


@dataclass
class Serve:
    proc: subprocess.Popen
    log_dir: Path
    lines: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)

    def wait_for(self, pattern: str, timeout: float = STARTUP_S, stream: str = "out", after: int = 0) -> re.Match:
        """The first line matching ``pattern`` (a regex) at index >= ``after`` of stdout or stderr."""
        lines = self.lines if stream == "out" else self.err
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in lines[after:]:
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the readers drain
                for line in lines[after:]:
                    if m := re.search(pattern, line):
                        return m
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout:.0f}s (serve rc={self.proc.poll()}):\n"
                             f"{''.join(self.lines)}\nstderr:\n{''.join(self.err)}")

    @property
    def router(self) -> str:
        return self.wait_for(r"router listening on (\S+)").group(1)

    def worker_address(self, i: int) -> str:
        return self.wait_for(rf"worker {i}\s+(\S+)").group(1)

    def pids(self) -> dict[str, int]:
        return json.loads((self.log_dir / "pids.json").read_text())


@pytest.fixture
def serve(model_factory, tmp_path) -> Iterator:
    started: list[Serve] = []

    def start(*extra: str) -> Serve:
        log_dir = tmp_path / f"logs{len(started)}"
        cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(model_factory("tiny")), "--port", "0",
               "--log-dir", str(log_dir), "--probe-interval", "0.3", "--restart-backoff", str(BACKOFF_S),
               *ENGINE_FLAGS, *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        s = Serve(proc, log_dir)
        for stream, sink in ((proc.stdout, s.lines), (proc.stderr, s.err)):
            threading.Thread(target=lambda st=stream, sk=sink: sk.extend(iter(st.readline, "")), daemon=True).start()
        started.append(s)
        s.wait_for("serving; Ctrl-C or SIGTERM stops the cluster")
        return s

    yield start
    for s in started:
        family = descendants(s.proc.pid) if s.proc.poll() is None else []
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            try:
                s.proc.wait(60)
            except subprocess.TimeoutExpired:
                s.proc.kill()
        for pid in family:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _generate(client: RouterClient) -> None:
    client.generate_text("Hello", max_new_tokens=2, temperature=0, ignore_eos=True)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.1)
    return time.monotonic() - start


def _all_groups_serving(client: RouterClient) -> bool:
    groups = client.list_workers().groups
    return bool(groups) and all(g.health == rpb.WORKER_HEALTH_SERVING for g in groups)


@pytest.mark.timeout(600)
def test_dead_dp_group_is_restarted_while_the_other_serves(serve):
    s = serve("--dp", "2")
    pids, worker0 = s.pids(), s.worker_address(0)
    with RouterClient(s.router, timeout=30) as client:
        _generate(client)
        os.kill(pids["worker 0"], signal.SIGKILL)
        killed = time.monotonic()
        outcomes: list[tuple[float, str]] = []
        while time.monotonic() - killed < 3.0:  # new requests right after the kill
            sent = time.monotonic() - killed
            try:
                _generate(client)
                outcomes.append((sent, "OK"))
            except grpc.RpcError as exc:
                outcomes.append((sent, exc.code().name))
        first_ok = min(t for t, code in outcomes if code == "OK")
        assert first_ok < 2.0, outcomes
        assert all(code == "OK" for t, code in outcomes if t >= 2.0), outcomes

        m = s.wait_for(r"worker 0 is back \(pid (\d+), port (\d+)\) ([\d.]+)s after it failed", stream="err",
                       timeout=BACKOFF_S + STARTUP_S)
        assert int(m.group(1)) != pids["worker 0"] and alive(int(m.group(1)))
        assert worker0.endswith(f":{m.group(2)}")  # the same port: the router's list is fixed
        assert "worker 0 exited with code -9 unexpectedly; restarting it" in "".join(s.err)
        back_in = _wait(lambda: _all_groups_serving(client), 30, "router sees both groups SERVING")
        assert _health(worker0) == health_pb2.HealthCheckResponse.SERVING
        for _ in range(4):  # both groups take requests again
            _generate(client)
        assert s.proc.poll() is None and alive(pids["worker 1"]) and alive(pids["router"])
    print(f"\n[dp] requests OK again {first_ok:.2f}s after the kill ({len(outcomes)} sent in 3 s, "
          f"{sum(c != 'OK' for _, c in outcomes)} failed); worker 0 SERVING {m.group(3)}s after the kill, "
          f"router saw it {back_in:.1f}s later")


@pytest.mark.timeout(600)
def test_dead_tokenizer_and_router_are_restarted_on_their_ports(serve):
    s = serve()
    router = s.router
    with RouterClient(router, timeout=30) as client:
        _generate(client)
        for name in ("tokenizer", "router"):
            old = s.pids()[name]
            after = len(s.err)
            os.kill(old, signal.SIGKILL)
            m = s.wait_for(rf"{name} is back \(pid (\d+), port (\d+)\) ([\d.]+)s", stream="err", after=after,
                           timeout=BACKOFF_S + STARTUP_S)
            assert int(m.group(1)) == s.pids()[name] != old
            _wait(lambda: client.health() == health_pb2.HealthCheckResponse.SERVING, 30, f"router SERVING after {name}")
            _generate(client)  # the same router address, with the new tokenizer / through the new router
            print(f"\n[{name}] back on port {m.group(2)} {m.group(3)}s after the kill")
    assert router.endswith(f":{m.group(2)}")


def _rank_processes(leader: int) -> list[int]:
    followers = children_of(leader)
    assert len(followers) == 1, followers
    return [leader, *followers]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dead_tp_follower_restarts_its_group(serve):
    s = serve("--tp", "2")
    pids, worker0 = s.pids(), s.worker_address(0)
    leader, follower = _rank_processes(pids["worker 0"])

    # F5: every socket the ranks listen on (gRPC, TCPStore, heartbeat, gloo) is on loopback.
    for pid in (leader, follower):
        listeners = listening_sockets(pid)
        assert listeners and all(is_loopback(addr) for addr, _ in listeners), (pid, listeners)
    # The group secret reaches the follower through a pipe: only the pipe's fd number is in its
    # environment, nothing secret in argv.
    environ = dict(e.split("=", 1) for e in Path(f"/proc/{follower}/environ").read_text().split("\0") if "=" in e)
    assert environ["LLMSERVE_TP_SECRET_FD"].isdigit()
    assert not any(re.fullmatch(r"[0-9a-f]{32,}", v) for v in environ.values())
    cmdlines = " ".join(Path(f"/proc/{p}/cmdline").read_text() for p in (leader, follower))
    assert "secret" not in cmdlines

    with RouterClient(s.router, timeout=30) as client:
        _generate(client)
        os.kill(follower, signal.SIGKILL)
        killed = time.monotonic()
        m = s.wait_for(r"worker 0 is back \(pid (\d+), port (\d+)\) ([\d.]+)s after it failed", stream="err",
                       timeout=30 + BACKOFF_S + STARTUP_S)
        err = "".join(s.err)
        assert "worker 0 exited with code 1 unexpectedly; restarting it" in err, err
        assert "tensor-parallel group broken; exiting" in err  # the leader's own log tail
        new_leader = int(m.group(1))
        assert new_leader != leader and not alive(leader) and worker0.endswith(f":{m.group(2)}")
        assert len(children_of(new_leader)) == 1  # a fresh follower
        _wait(lambda: _all_groups_serving(client), 30, "router sees the group SERVING")
        _generate(client)
        recovered = time.monotonic() - killed
    print(f"\n[tp] group serving again {recovered:.1f}s after its follower was killed (leader healthy "
          f"{m.group(3)}s after it exited)")


@pytest.mark.timeout(600)
def test_no_child_outlives_a_killed_serve(serve):
    s = serve("--tp", "2")
    family = descendants(s.proc.pid)
    # tokenizer, router, the TP leader and its follower (a grandchild)
    assert len(family) == 4, family
    assert set(s.pids().values()) < set(family)
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    killed = time.monotonic()
    gone_in = _wait(lambda: not any(alive(p) for p in family), 5.0, "every child and grandchild gone")
    print(f"\n[kill -9 serve] all {len(family)} descendants gone {gone_in:.2f}s after the kill")
    assert time.monotonic() - killed < 5.0


# ---- one process per rank (`--tp-rank`, as in compose): the leader exits when its group breaks ----


def _start_ranks(model: Path, workdir: Path, secrets: tuple[bytes, bytes], *leader_flags: str,
                 connect_timeout: float = 120.0):
    from tests.integration.test_tp_worker import _start_rank
    from worker_svc.parallel.group import free_port

    addr = f"127.0.0.1:{free_port()}"
    ranks = []
    for rank, secret in ((1, secrets[1]), (0, secrets[0])):
        secret_file = workdir / f"secret{rank}"
        secret_file.write_bytes(secret)
        secret_file.chmod(0o600)
        flags = ["--tp-size", "2", "--tp-rank", str(rank), "--dist-init-addr", addr, "--tp-timeout", "4",
                 "--tp-connect-timeout", str(connect_timeout), "--tp-secret-file", str(secret_file),
                 "--shutdown-grace", "1", *(leader_flags if rank == 0 else ())]
        ranks.append(_start_rank(model, workdir, f"rank{rank}", *flags))
    follower, leader = ranks
    return leader, follower


@pytest.fixture
def rank_pair(worker_model, tmp_path):
    started = []

    def start(*args, **kwargs):
        pair = _start_ranks(worker_model, tmp_path, *args, **kwargs)
        started.extend(pair)
        return pair

    yield start
    for rank in started:
        if rank.proc.poll() is None:
            rank.proc.kill()
            rank.proc.wait(10)


@pytest.mark.timeout(300)
def test_broken_tp_leader_exits_1_by_itself(rank_pair):
    from tests.integration.test_tp_worker import _wait_serving

    secret = os.urandom(32)
    leader, follower = rank_pair((secret, secret))
    _wait_serving([leader, follower], timeout=STARTUP_S)
    assert _health(leader.address) == health_pb2.HealthCheckResponse.SERVING
    os.kill(follower.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert leader.proc.wait(30) == 1, leader.tail()  # no zombie group: a supervisor can restart it
    took = time.monotonic() - killed
    assert "tensor-parallel group broken; exiting" in leader.tail()
    assert secret.hex() not in leader.tail() + follower.tail()
    print(f"\n[tp rank pair] leader exited 1 {took:.1f}s after its follower was killed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_follower_with_another_group_secret_is_refused(rank_pair):
    leader, follower = rank_pair((os.urandom(32), os.urandom(32)), connect_timeout=15.0)
    assert follower.proc.wait(STARTUP_S) == 1, follower.tail()
    assert "handshake" in follower.tail()
    assert leader.proc.wait(60) != 0  # it never got its follower
    assert "tp heartbeat connection refused" in leader.tail()
    assert not leader.port_file.exists()  # never served
