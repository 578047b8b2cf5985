"""Fixtures for the services over real gRPC on 127.0.0.1: an in-process model worker (grpc.aio server
on a background thread) and helpers that start `llmserve worker` as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from worker_svc.config.engine_config import EngineConfig
from worker_svc.engine.engine import Engine

# A small KV pool and context so "can never fit" is cheap to provoke; fp32 so results are exact.
WORKER_ENGINE = dict(
    dtype="float32",
    max_total_tokens=512,
    max_running_requests=4,
    chunked_prefill_size=64,
    max_prefill_tokens=128,
    context_length=256,
)


def worker_engine_config(model_dir: Path, **overrides) -> EngineConfig:
    return EngineConfig(model_path=str(model_dir), **{**WORKER_ENGINE, **overrides})


def engine_cli_flags(**overrides) -> list[str]:
    settings = {**WORKER_ENGINE, **overrides}
    flags: list[str] = []
    for key, value in settings.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


@pytest.fixture(scope="module")
def worker_model(model_factory) -> Path:
    return model_factory("tiny")


@pytest.fixture(scope="module")
def reference_engine(worker_model) -> Engine:
    """An in-process engine with the worker's settings: the oracle for what the worker returns."""
    return Engine(worker_engine_config(worker_model))


@pytest.fixture(scope="module")
def inproc_worker(worker_model):
    """A WorkerServer on 127.0.0.1 (ephemeral port), run by a background event loop."""
    from worker_svc.server.app import ServerThread, WorkerServer
    from worker_svc.server.servicer import WorkerOptions

    engine = Engine(worker_engine_config(worker_model))
    server = WorkerServer(engine, host="127.0.0.1", port=0, options=WorkerOptions(served_model_name="tiny-test"))
    thread = ServerThread(server)
    thread.start()
    yield thread
    thread.stop(grace=0.5)


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_records(self) -> list[dict]:
        records = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def launch_worker(model_dir: Path, workdir: Path, *extra: str, timeout: float = 90.0, **engine) -> WorkerProcess:
    """Start `llmserve worker --port 0 --port-file ... --log-json` and wait until it serves."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "worker.port"
    port_file.unlink(missing_ok=True)
    log_path = workdir / "worker.log"
    cmd = [
        sys.executable, "-m", "llmserve.cli", "worker",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", "0",
        "--port-file", str(port_file), "--log-json", *engine_cli_flags(**engine), *extra,
    ]
    # One intra-op thread: tiny models gain nothing from more, and the machine is shared.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"worker did not start in {timeout}s:\n{log_path.read_text(errors='replace')[-4000:]}")
        time.sleep(0.05)
    return WorkerProcess(proc=proc, port=int(port_file.read_text()), log_path=log_path)


@pytest.fixture
def worker_process_factory(tmp_path) -> Iterator:
    started: list[WorkerProcess] = []

    def start(model_dir: Path, *extra: str, **engine) -> WorkerProcess:
        worker = launch_worker(model_dir, tmp_path / f"worker{len(started)}", *extra, **engine)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.terminate()
