"""`llmserve worker` with tensor parallelism, as real processes over gloo on 127.0.0.1 (tiny model, fp32):
TP=2 serves the TP=1 engine's greedy tokens and frees the KV pool after a cancel; a follower killed or
stopped mid-generation fails the request with UNAVAILABLE within the bound and turns health
NOT_SERVING; a follower whose leader dies exits; SIGTERM on the leader ends every rank with 0.

Ranks are started one process each (``--tp-rank``) wherever the test needs every pid; ``--tp 2`` (rank 0
starts rank 1) is checked through /proc.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from tests.integration.conftest import WORKER_ENGINE, engine_cli_flags
from worker_svc.parallel import shm_communicator
from worker_svc.parallel.group import free_port
from worker_svc.sampling import SamplingParams

FAULT_TIMEOUT_S = 4.0  # --tp-timeout of the fault tests
SLACK_S = 6.0  # scheduling noise on a shared 2-core machine


def _request(ids, max_new: int, rid: str = "", stream: bool = False) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=max_new),
        stream=stream,
    )


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return (
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        )


def _children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.05)
    return time.monotonic() - start


@dataclass
class Rank:
    proc: subprocess.Popen
    port_file: Path
    log: Path

    @property
    def port(self) -> int:
        return int(self.port_file.read_text())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _start_rank(model: Path, workdir: Path, name: str, *flags: str) -> Rank:
    workdir.mkdir(parents=True, exist_ok=True)
    port_file, log = workdir / f"{name}.port", workdir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "llmserve.cli",
        "worker",
        "--model",
        str(model),
        *engine_cli_flags(),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        *flags,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=workdir)
    return Rank(proc, port_file, log)


def _wait_serving(ranks: list[Rank], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(r.port_file.exists() for r in ranks):
        for r in ranks:
            if r.proc.poll() is not None:
                raise RuntimeError(f"rank exited with {r.proc.returncode}:\n{r.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError("ranks did not start:\n" + "\n".join(r.tail() for r in ranks))
        time.sleep(0.05)


DEFAULT_COMM = "shm" if shm_communicator.available() is None else "gloo"


@pytest.fixture
def tp_ranks(worker_model, tmp_path):
    """start(*leader_flags, timeout=..., comm=...) -> [leader, follower], one process per rank (kills
    leftovers); afterwards no shared-memory segment of theirs is left in /dev/shm."""
    started: list[Rank] = []
    segments_before = shm_communicator.segment_names()

    def start(*leader_flags: str, tp_timeout: float = 15.0, comm: str = DEFAULT_COMM,
              overlap: bool = False) -> list[Rank]:
        addr = f"127.0.0.1:{free_port()}"
        common = ("--tp-size", "2", "--dist-init-addr", addr, "--tp-timeout", str(tp_timeout), "--shutdown-grace", "1",
                  "--tp-comm", comm, *(("--enable-two-batch-overlap", "--tbo-min-tokens", "2") if overlap else ()))
        follower = _start_rank(worker_model, tmp_path, "rank1", *common, "--tp-rank", "1")
        leader = _start_rank(worker_model, tmp_path, "rank0", *common, "--tp-rank", "0", *leader_flags)
        started.extend([leader, follower])
        _wait_serving([leader, follower])
        return [leader, follower]

    yield start
    for rank in started:
        if rank.proc.poll() is None:
            rank.proc.kill()
        if rank.proc.poll() is None and rank.proc.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rank.proc.wait(10)
        with contextlib.suppress(OSError):
            os.kill(rank.proc.pid, signal.SIGCONT)
    assert shm_communicator.segment_names() <= segments_before, "a tp group left its shared-memory segment behind"


def test_tp2_worker_matches_tp1_engine_and_frees_kv_on_cancel(worker_model, reference_engine, worker_process_factory):
    worker = worker_process_factory(worker_model, "--tp", "2")
    followers = _children_of(worker.proc.pid)
    assert len(followers) == 1, followers
    prompts = [[(7 * i + 3 * j) % 500 for j in range(5 + 9 * i)] for i in range(3)]
    expected = [
        r.output_ids
        for r in reference_engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    ]
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        for prompt, want in zip(prompts, expected, strict=False):
            (resp,) = list(stub.Generate(_request(prompt, 16), timeout=60))
            assert list(resp.complete.output_ids) == want
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert info.server_args["tp_size"] == 2
        assert info.server_args["tp_comm"] == DEFAULT_COMM  # --tp-comm auto: shared memory on one host
        assert info.scheduler_info["tp_comm"] == DEFAULT_COMM

        # A client cancel mid-stream frees every KV slot again.
        call = stub.Generate(_request(prompts[0], 200, rid="cancel-me", stream=True), timeout=60)
        next(call)
        call.cancel()

        def all_free() -> bool:
            load = stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0]
            return (
                load.num_used_tokens == 0
                and load.num_running_reqs == 0
                and load.max_total_num_tokens == WORKER_ENGINE["max_total_tokens"]
            )

        _wait(all_free, 30, "KV pool free after cancel")
        (resp,) = list(stub.Generate(_request(prompts[1], 16), timeout=60))  # still serving
        assert list(resp.complete.output_ids) == expected[1]
    assert _health(worker.address) == health_pb2.HealthCheckResponse.SERVING
    assert worker.terminate() == 0
    _wait(lambda: all(_gone(pid) for pid in followers), 30, "rank 1 exits with its leader")


def test_tp2_worker_with_two_batch_overlap_serves_concurrent_requests(worker_model, reference_engine,
                                                                     worker_process_factory):
    """--enable-two-batch-overlap on a TP=2 worker (shared memory when available): concurrent streams,
    so steps hold several requests and get split, give the TP=1 engine's greedy tokens."""
    worker = worker_process_factory(worker_model, "--tp", "2", "--enable-two-batch-overlap", "--tbo-min-tokens", "2")
    prompts = [[(5 * i + 11 * j) % 500 for j in range(4 + 7 * i)] for i in range(4)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [r.output_ids for r in reference_engine.generate(prompts, params)]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        with grpc.insecure_channel(worker.address) as channel:
            (resp,) = list(pb_grpc.SglangSchedulerStub(channel).Generate(_request(prompts[i], 12), timeout=60))
            results[i] = list(resp.complete.output_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert [results.get(i) for i in range(len(prompts))] == expected
    assert worker.terminate() == 0


def test_sigterm_on_leader_ends_every_rank_with_0(tp_ranks):
    leader, follower = tp_ranks()
    assert _health(follower.address) == health_pb2.HealthCheckResponse.SERVING
    assert _health(leader.address, "sglang.grpc.scheduler.SglangScheduler") == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(leader.address) as channel:
        (resp,) = list(pb_grpc.SglangSchedulerStub(channel).Generate(_request([1, 2, 3], 8), timeout=60))
        assert len(resp.complete.output_ids) == 8
    leader.proc.send_signal(signal.SIGTERM)
    assert leader.proc.wait(30) == 0, leader.tail()
    assert follower.proc.wait(30) == 0, follower.tail()


def _generate_in_background(address: str, prompt: list[int], max_new: int):
    """Start a streaming Generate; returns (first_chunk_event, result dict filled when the call ends)."""
    first, result = threading.Event(), {}

    def run() -> None:
        with grpc.insecure_channel(address) as channel:
            try:
                for _ in pb_grpc.SglangSchedulerStub(channel).Generate(
                    _request(prompt, max_new, stream=True), timeout=120
                ):
                    first.set()
                result["code"] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                result["code"], result["details"] = exc.code(), exc.details()
            result["ended"] = time.monotonic()
            first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return first, result, thread


FAULT_CASES = [("kill", DEFAULT_COMM, False), ("hang", DEFAULT_COMM, False), ("kill", "gloo", False),
               ("kill", DEFAULT_COMM, True)]  # the last with two-batch overlap: two requests, split steps


@pytest.mark.parametrize(("fault", "comm", "overlap"), FAULT_CASES)
def test_follower_fault_fails_in_flight_request_and_health(tp_ranks, fault, comm, overlap):
    # 50 ms per step: 200 tokens keep the request in flight for ~10 s.
    # --tp-fault-exit-delay inf: the leader stays up NOT_SERVING (checked below) instead of exiting.
    leader, follower = tp_ranks(
        "--debug-step-delay", "0.05", "--tp-fault-exit-delay", "inf", tp_timeout=FAULT_TIMEOUT_S, comm=comm,
        overlap=overlap,
    )
    calls = [_generate_in_background(leader.address, [5, 6, 7, 8 + i], 200) for i in range(2 if overlap else 1)]
    for first, result, _ in calls:
        assert first.wait(60)
        assert "code" not in result  # still generating
    faulted = time.monotonic()
    os.kill(follower.proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    bound = (1.0 if fault == "kill" else FAULT_TIMEOUT_S) + SLACK_S
    for _, result, thread in calls:
        thread.join(FAULT_TIMEOUT_S + SLACK_S + 30)
        assert result.get("code") == grpc.StatusCode.UNAVAILABLE, (result, leader.tail())
        assert result["ended"] - faulted < bound, result["ended"] - faulted

    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert _health(leader.address) == not_serving
    assert _health(leader.address, "sglang.grpc.scheduler.SglangScheduler") == not_serving
    with grpc.insecure_channel(leader.address) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_request([1, 2], 4), timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy

    # The leader keeps answering NOT_SERVING until signalled, then exits 1 (the group broke).
    leader.proc.send_signal(signal.SIGTERM)
    assert leader.proc.wait(FAULT_TIMEOUT_S + SLACK_S + 10) == 1, leader.tail()
    if fault == "hang":  # the stopped follower was told to abort; it acts on it once it runs again
        os.kill(follower.proc.pid, signal.SIGCONT)
        assert follower.proc.wait(FAULT_TIMEOUT_S + SLACK_S) == 1, follower.tail()
    else:
        assert follower.proc.wait(10) == -signal.SIGKILL


def test_follower_exits_when_its_leader_dies(tp_ranks):
    leader, follower = tp_ranks(tp_timeout=FAULT_TIMEOUT_S)
    leader.proc.kill()
    leader.proc.wait(10)
    took = _wait(lambda: follower.proc.poll() is not None, FAULT_TIMEOUT_S + SLACK_S, "follower exit")
    assert follower.proc.returncode == 1, follower.tail()
    assert took < FAULT_TIMEOUT_S + SLACK_S
