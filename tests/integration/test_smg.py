"""The smg gateway (PyPI `smg==1.13.0`, a Rust binary) in front of our worker, all on 127.0.0.1.

smg speaks OpenAI HTTP to the client and sglang.grpc.scheduler.SglangScheduler to the worker: it
tokenizes (and renders the chat template) itself, streams Generate, detokenizes, and sends Abort when
the HTTP client goes away. The worker's tokens, decoded, must be the in-process engine's greedy
tokens decoded with the same tokenizer.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import jinja2
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from tokenizers import Tokenizer

from tests.integration.conftest import launch_worker, worker_engine_config
from worker_svc.engine.engine import Engine
from worker_svc.sampling import SamplingParams

SMG = Path(sys.executable).parent / "smg"
MODEL_NAME = "tiny-smg"
# A longer context than the other tests use, so a generation outlives a dropped HTTP client.
ENGINE = dict(context_length=1024, max_total_tokens=1024)

pytestmark = pytest.mark.skipif(
    not SMG.exists(), reason=f"smg gateway binary missing at {SMG}: pip install smg==1.13.0 (a test dependency)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    def __init__(self, worker_address: str | list[str], workdir: Path, tokenizer_path: Path | None,
                 policy: str = "round_robin", extra: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.metrics_port = _free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "smg.log"
        addresses = [worker_address] if isinstance(worker_address, str) else worker_address
        cmd = [
            str(SMG), "launch",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--worker-urls", *(f"grpc://{a}" for a in addresses),
            "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            *extra,
        ]
        if tokenizer_path is not None:
            cmd += ["--tokenizer-path", str(tokenizer_path)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the worker is registered and healthy (its model is listed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                status, body = self.request("GET", "/v1/models")
                if status == 200 and any(m["id"] == MODEL_NAME for m in json.loads(body)["data"]):
                    return
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"smg not ready after {timeout}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.metrics_port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        conn = self.connection()
        try:
            payload = json.dumps(body) if body is not None else None
            conn.request(method, path, payload, {"content-type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def post(self, path: str, body: dict) -> dict:
        status, data = self.request("POST", path, body)
        assert status == 200, data
        return json.loads(data)

    def stream(self, path: str, body: dict) -> list[dict]:
        conn = self.connection()
        try:
            conn.request("POST", path, json.dumps({**body, "stream": True}), {"content-type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200, response.read()
            events = []
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                events.append(json.loads(data))
            return events
        finally:
            conn.close()

    def stop(self) -> None:
        # On SIGTERM smg keeps listening for a fixed 5 s "load-balancer propagation window" (not
        # configurable from `smg launch`); nothing here needs its drain.
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(0.5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def model_dir(model_factory) -> Path:
    return model_factory("tiny")


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(worker_engine_config(model_dir, **ENGINE))


@pytest.fixture(scope="module")
def worker(model_dir, tmp_path_factory):
    proc = launch_worker(model_dir, tmp_path_factory.mktemp("smg-worker"), "--served-model-name", MODEL_NAME, **ENGINE)
    yield proc
    assert proc.terminate() == 0


@pytest.fixture(scope="module")
def gateway(worker, model_dir, tmp_path_factory):
    gw = Gateway(worker.address, tmp_path_factory.mktemp("smg"), tokenizer_path=model_dir)
    try:
        gw.wait_ready()
        yield gw
    finally:
        gw.stop()


def _expected(engine: Engine, tokenizer: Tokenizer, prompt_ids: list[int], max_tokens: int) -> tuple[str, str]:
    """(text, finish_reason) of the engine's greedy continuation, decoded as the gateway does."""
    (result,) = engine.generate([prompt_ids], SamplingParams(max_new_tokens=max_tokens, temperature=0.0))
    return tokenizer.decode(result.output_ids, skip_special_tokens=True), result.finish_reason.value


def _chat_prompt_ids(model_dir: Path, tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    text = jinja2.Template(config["chat_template"]).render(
        messages=messages, add_generation_prompt=True, bos_token=config["bos_token"], eos_token=config["eos_token"]
    )
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_completions(gateway, engine, tokenizer):
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    response = gateway.post("/v1/completions", body)
    (choice,) = response["choices"]
    assert response["usage"]["prompt_tokens"] == len(ids)
    assert (choice["text"], choice["finish_reason"]) == _expected(engine, tokenizer, ids, 12)


def test_chat_completions_streaming_and_not(gateway, engine, tokenizer, model_dir):
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    ids = _chat_prompt_ids(model_dir, tokenizer, messages)
    expected = _expected(engine, tokenizer, ids, 16)
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 16, "temperature": 0}

    response = gateway.post("/v1/chat/completions", body)
    (choice,) = response["choices"]
    assert response["usage"]["prompt_tokens"] == len(ids)
    assert (choice["message"]["content"], choice["finish_reason"]) == expected

    events = gateway.stream("/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
    reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert ("".join(deltas), reasons) == (expected[0], [expected[1]])


def _worker_loads(address: str) -> pb.SchedulerLoad:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.SglangSchedulerStub(ch).GetLoads(pb.GetLoadsRequest(), timeout=30).loads[0]


def test_dropped_http_client_aborts_on_the_worker(gateway, worker):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    conn = gateway.connection()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    request_id = None
    while request_id is None:  # wait until tokens flow, then hang up
        line = response.fp.readline().decode().strip()
        if line.startswith("data:") and '"content"' in line:
            request_id = json.loads(line[len("data:"):])["id"]
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()

    deadline = time.monotonic() + 20
    while True:
        load = _worker_loads(worker.address)
        if load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0:
            break  # free == total
        assert time.monotonic() < deadline, f"worker still busy: {load}"
        time.sleep(0.05)

    # smg forwards its request id (the response's "id") to the worker, which logged the Abort RPC.
    deadline = time.monotonic() + 10
    while True:
        records = [r for r in worker.log_records() if r.get("request_id") == request_id]
        events = {r["event"] for r in records}
        finished = [r for r in records if r["event"] == "generate finished"]
        if "abort" in events and finished:
            break
        assert time.monotonic() < deadline, f"no Abort for {request_id} in the worker log: {records}"
        time.sleep(0.05)
    assert finished[0]["finish_reason"] == "abort" and finished[0]["completion_tokens"] < 900


def test_gateway_fetches_the_tokenizer_from_the_worker(model_dir, engine, tokenizer, tmp_path):
    """Without --tokenizer-path, smg 1.13 takes the tokenizer from GetTokenizer when the worker
    advertises a model path the gateway's host does not have (an empty one it cannot use at all)."""
    from worker_svc.server.app import ServerThread, WorkerServer
    from worker_svc.server.servicer import WorkerOptions

    server = WorkerServer(
        Engine(worker_engine_config(model_dir, **ENGINE)),
        options=WorkerOptions(served_model_name=MODEL_NAME, advertised_model_path="/nonexistent/llmserve/tiny"),
    )
    thread = ServerThread(server)
    thread.start()
    gw = Gateway(thread.address, tmp_path / "smg", tokenizer_path=None)
    try:
        gw.wait_ready()
        prompt = "Hello world"
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        deadline = time.monotonic() + 30
        while True:  # the tokenizer is registered by a background job
            status, data = gw.request(
                "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            )
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == 200, data
        (choice,) = json.loads(data)["choices"]
        assert (choice["text"], choice["finish_reason"]) == _expected(engine, tokenizer, ids, 8)
        assert "Fetching tokenizer from worker" in gw.log()
    finally:
        gw.stop()
        thread.stop(grace=0.5)


# ---- cache_aware (smg's default policy) over two workers, routing by their KV events ----------------


@pytest.fixture(scope="module")
def two_workers(model_dir, tmp_path_factory):
    procs = [launch_worker(model_dir, tmp_path_factory.mktemp(f"smg-kv-worker{i}"), "--served-model-name", MODEL_NAME,
                           **ENGINE) for i in range(2)]
    yield procs
    for proc in procs:
        assert proc.terminate() == 0


def _served_by(workers, request_id: str) -> list[int]:
    """Which workers logged a Generate of smg's request ``request_id`` (its response "id")."""
    return [i for i, w in enumerate(workers)
            if any(r.get("request_id") == request_id and r["event"] == "generate accepted" for r in w.log_records())]


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of the Prometheus sample ``name`` whose labels include ``labels`` (0 if none)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _stored_blocks(gw: Gateway, worker) -> float:
    return _metric(gw.metrics(), "smg_kv_event_blocks_total", op="stored", worker=f"grpc://{worker.address}")


def _wait_stored(gw: Gateway, worker, at_least: float, since: float = 0.0, timeout: float = 20.0) -> None:
    """Until smg has applied ``at_least`` stored blocks from ``worker`` (beyond ``since``)."""
    deadline = time.monotonic() + timeout
    while _stored_blocks(gw, worker) - since < at_least:
        assert time.monotonic() < deadline, f"smg did not get the KV events of {worker.address}"
        time.sleep(0.05)


def _warm(address: str, ids: list[int]) -> None:
    """Cache ``ids`` on one worker by a Generate straight to it: smg never sees this request."""
    request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids),
                                 sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=1))
    with grpc.insecure_channel(address) as ch:
        list(pb_grpc.SglangSchedulerStub(ch).Generate(request, timeout=30))


def test_cache_aware_routes_by_the_workers_kv_events(two_workers, model_dir, engine, tokenizer, tmp_path):
    """smg 1.13's default policy subscribes to both workers' KV events and sends a prompt to the
    worker whose cache holds it: one cached there behind smg's back (a Generate straight to the
    worker), and the repeats of one smg itself placed (usage reports the cached tokens)."""
    gw = Gateway([w.address for w in two_workers], tmp_path / "smg", tokenizer_path=model_dir, policy="cache_aware")
    try:
        gw.wait_ready()
        deadline = time.monotonic() + 30
        while not all(any(r["event"] == "KV event subscriber joined" for r in w.log_records()) for w in two_workers):
            assert time.monotonic() < deadline, f"smg did not subscribe to KV events:\n{gw.log()[-3000:]}"
            time.sleep(0.1)
        texts = [f"Story {i}: " + " ".join(f"word{i}x{j}" for j in range(60)) for i in range(4)]
        ids = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
        # Each worker caches two of the prompts behind smg's back; smg must find them by their events.
        for k, prompt_ids in enumerate(ids):
            before = _stored_blocks(gw, two_workers[k % 2])
            _warm(two_workers[k % 2].address, prompt_ids)
            _wait_stored(gw, two_workers[k % 2], before + len(prompt_ids) // 16)  # the events reached smg
        for k, (text, prompt_ids) in enumerate(zip(texts, ids, strict=True)):
            body = {"model": MODEL_NAME, "prompt": text, "max_tokens": 4, "temperature": 0}
            response = gw.post("/v1/completions", body)
            (choice,) = response["choices"]
            assert (choice["text"], choice["finish_reason"]) == _expected(engine, tokenizer, prompt_ids, 4)
            assert _served_by(two_workers, response["id"]) == [k % 2], f"prompt {k} went elsewhere"
            assert response["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt_ids) - 16
        # A long prompt smg places itself (a miss: the less loaded worker); its repeats go there too.
        text = "A longer tale: " + " ".join(f"step{j}" for j in range(80))
        prompt_ids = tokenizer.encode(text, add_special_tokens=False).ids
        served, cached = [], []
        body = {"model": MODEL_NAME, "prompt": text, "max_tokens": 4, "temperature": 0}
        counts_before = [_stored_blocks(gw, w) for w in two_workers]
        for _ in range(3):
            response = gw.post("/v1/completions", body)
            # (smg holds back a trailing incomplete UTF-8 sequence that the tokenizer decodes to U+FFFD)
            expected = _expected(engine, tokenizer, prompt_ids, 4)[0].rstrip("\ufffd")
            assert response["choices"][0]["text"].rstrip("\ufffd") == expected
            served += _served_by(two_workers, response["id"])
            cached.append(response["usage"]["prompt_tokens_details"]["cached_tokens"])
            if len(cached) == 1:  # its KV events reach smg before the repeat
                _wait_stored(gw, two_workers[served[0]], 1, since=counts_before[served[0]])
        assert len(set(served)) == 1 and len(served) == 3, served
        assert cached[0] == 0 and all(c >= len(prompt_ids) - 16 for c in cached[1:]), cached
        # smg's own account: every cache hit came from the event index, fed by both workers' streams.
        metrics = gw.metrics()
        assert _metric(metrics, "smg_cache_aware_policy_branch_total", branch="event_hit") >= 6, metrics[-3000:]
        for w in two_workers:
            labels = {"worker": f"grpc://{w.address}"}
            assert _metric(metrics, "smg_kv_event_batches_total", disposition="applied", **labels) > 0
            assert _metric(metrics, "smg_kv_event_blocks_total", op="stored", **labels) > 0
        assert "Learned block_size from KV event" in gw.log()
    finally:
        gw.stop()
