"""The whole cluster on loopback, as real processes: `llmserve tokenizer`, two `llmserve worker`s and
`llmserve router`, driven through the router's public API.

The cluster is shared by the module; the last test kills the workers, so it must stay last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
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
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2 as spb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc

from llmserve.v1 import router_pb2 as pb
from llmserve.v1 import router_pb2_grpc as pb_grpc
from router.client import AsyncRouterClient, RouterClient, collect
from tokenizer_svc.tokenizer import ModelTokenizer

TIMEOUT = 30.0
# Both workers and the in-process reference engine use these settings (fp32: exact comparisons).
ENGINE = dict(dtype="float32", max_total_tokens=2048, max_running_requests=16, chunked_prefill_size=64,
              max_prefill_tokens=256, context_length=256)
CONTEXT = ENGINE["context_length"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Hello, my name is",
           "In 1492, Columbus", "The quick brown fox", "Rain falls on", "Numbers: 1, 2, 3,"]


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    port_file: Path
    log_path: Path
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_port(self, deadline: float) -> None:
        while not self.port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n{self.tail()}")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text())

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def log_records(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def spawn(name: str, args: list[str], workdir: Path) -> Proc:
    port_file, log_path = workdir / f"{name}.port", workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "llmserve.cli", *args, "--host", "127.0.0.1", "--port", "0",
           "--port-file", str(port_file), "--log-json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    return Proc(name, proc, port_file, log_path)


def engine_flags() -> list[str]:
    return [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]


@contextlib.contextmanager
def one_group_cluster(model: Path, workdir: Path, worker_flags: list[str] | None = None,
                      router_flags: list[str] = (),
                      tokenizer_flags: list[str] = ()) -> Iterator[tuple[Proc, Proc, Proc]]:
    """(tokenizer, worker, router) as processes, the router SERVING; stopped on exit (SIGCONT
    first, for tests that SIGSTOP one)."""
    tokenizer = spawn("tokenizer", ["tokenizer", "--model", str(model), *tokenizer_flags], workdir)
    worker = spawn("worker", ["worker", "--model", str(model),
                              *(engine_flags() if worker_flags is None else worker_flags)], workdir)
    procs = [tokenizer, worker]
    try:
        deadline = time.monotonic() + 120
        for p in procs:
            p.wait_port(deadline)
        router = spawn("router", ["router", "--tokenizer", tokenizer.address, "--workers", worker.address,
                                  "--probe-interval", "0.3", *router_flags], workdir)
        procs.append(router)
        router.wait_port(deadline)
        wait_for(lambda: _health(router.address) == SERVING, 60, what="router SERVING")
        yield tokenizer, worker, router
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
        for p in reversed(procs):
            p.stop()


@dataclass
class Cluster:
    model: Path
    tokenizer: Proc
    workers: list[Proc]
    router: Proc
    procs: list[Proc] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.router.address

    def worker_loads(self, i: int) -> spb.SchedulerLoad:
        with grpc.insecure_channel(self.workers[i].address) as ch:
            return spb_grpc.SglangSchedulerStub(ch).GetLoads(spb.GetLoadsRequest(), timeout=5).loads[0]


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return -1


def wait_for(predicate, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def cluster(request, model_factory, tmp_path_factory) -> Iterator[Cluster]:
    """Two worker groups behind the router; with tp2 each group is two tensor-parallel ranks, and
    every test must give the same answers as the in-process TP=1 engine."""
    tp = request.param
    model = model_factory("tiny")
    workdir = tmp_path_factory.mktemp(f"cluster-tp{tp}")
    tokenizer = spawn("tokenizer", ["tokenizer", "--model", str(model)], workdir)
    tp_flags = ["--tp", str(tp)] if tp > 1 else []
    workers = [spawn(f"worker{i}", ["worker", "--model", str(model), *engine_flags(), *tp_flags], workdir)
               for i in range(2)]
    procs = [tokenizer, *workers]
    try:
        deadline = time.monotonic() + 120
        for p in procs:
            p.wait_port(deadline)
        router = spawn("router", ["router", "--tokenizer", tokenizer.address,
                                  "--workers", ",".join(w.address for w in workers),
                                  "--probe-interval", "0.3", "--health-every", "3"], workdir)
        procs.append(router)
        router.wait_port(deadline)
        wait_for(lambda: _health(router.address) == SERVING, 60, what="router SERVING")
        with RouterClient(router.address, timeout=5) as c:  # SERVING needs one group; the tests want both
            wait_for(lambda: all(g.health == pb.WORKER_HEALTH_SERVING for g in c.list_workers().groups), 60,
                     what="both worker groups SERVING")
        yield Cluster(model, tokenizer, workers, router, procs)
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[RouterClient]:
    with RouterClient(cluster.address, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def tok(cluster: Cluster) -> ModelTokenizer:
    return ModelTokenizer.from_dir(cluster.model)


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tok: ModelTokenizer):
    """greedy(prompt ids, n) -> output ids, from an in-process Engine with the workers' settings."""
    from worker_svc.config.engine_config import EngineConfig
    from worker_svc.engine.engine import Engine
    from worker_svc.sampling import SamplingParams

    engine = Engine(EngineConfig(model_path=str(cluster.model), **ENGINE))
    cache: dict[tuple, list[int]] = {}

    def greedy(ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(ids), max_new_tokens)
        if key not in cache:
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
            cache[key] = engine.generate([ids], params)[0].output_ids
        return cache[key]

    return greedy


# ---- serving -------------------------------------------------------------------------------------


def test_health_reflection_and_model_info(cluster: Cluster, client: RouterClient, tok: ModelTokenizer) -> None:
    with grpc.insecure_channel(cluster.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "llmserve.v1.Router"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == SERVING
        (reply,) = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for s in reply.list_services_response.service}
        assert {"llmserve.v1.Router", "grpc.health.v1.Health"} <= names
    info = client.model_info()
    assert info.model == cluster.model.name and info.vocab_size == 512 and info.context_length == CONTEXT
    assert list(info.eos_token_ids) == tok.eos_token_ids and info.bos_token_id == tok.bos_token_id
    assert info.has_chat_template and info.num_worker_groups == 2
    groups = client.list_workers().groups
    assert [g.health for g in groups] == [pb.WORKER_HEALTH_SERVING] * 2
    assert [g.address for g in groups] == [w.address for w in cluster.workers]
    assert all(g.load.max_total_tokens == ENGINE["max_total_tokens"] for g in groups)


def test_greedy_stream_equals_engine(client: RouterClient, tok: ModelTokenizer, reference) -> None:
    for prompt in PROMPTS[:3]:
        ids = client.tokenize(prompt)
        assert ids == tok.encode(prompt)
        want = reference(ids, 24)
        deltas = list(client.generate(prompt, max_new_tokens=24, temperature=0, ignore_eos=True))
        (c,) = collect(deltas)
        assert c.token_ids == want
        assert c.text == tok.decode(want, skip_special_tokens=True)
        assert c.finish.reason == "length" and c.finish.completion_tokens == 24
        assert c.finish.prompt_tokens == len(ids)
        # Streamed, not one blob: the first token comes alone. Later ones may come several to a delta when
        # the router falls behind a worker's steps (the worker stream merges them, docs/router.md).
        assert len(deltas[0].token_ids) == 1 and len(deltas) >= 3
        assert all(d.finish is None for d in deltas[:-1])


def test_chat_equals_engine_on_the_template(client: RouterClient, tok: ModelTokenizer, reference) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids, _ = tok.encode_chat(messages, add_generation_prompt=True)
    (c,) = collect(client.chat(messages, max_new_tokens=16, temperature=0, ignore_eos=True))
    assert c.token_ids == reference(ids, 16) and c.finish.prompt_tokens == len(ids)
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_32_concurrent_streams(cluster: Cluster, tok: ModelTokenizer, reference) -> None:
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    want = {p: reference(tok.encode(p), 16) for p in PROMPTS}

    async def run() -> list:
        async with AsyncRouterClient(cluster.address, timeout=60) as ac:
            async def one(prompt: str, i: int):
                deltas = [d async for d in ac.generate(prompt, max_new_tokens=16, temperature=0, ignore_eos=True,
                                                       request_id=f"concurrent-{i}")]
                return prompt, collect(deltas)[0]

            return await asyncio.gather(*(one(p, i) for i, p in enumerate(jobs)))

    results = asyncio.run(run())
    assert len(results) == 32
    for i, (prompt, c) in enumerate(results):
        assert c.request_id == f"concurrent-{i}"
        assert c.token_ids == want[prompt], prompt
        assert c.text == tok.decode(want[prompt], skip_special_tokens=True)
        assert c.finish.reason == "length"
    # least_load spread them over both groups.
    served = [sum(1 for r in cluster.workers[i].log_records()
                  if r.get("event") == "generate finished"
                  and str(r.get("client_request_id", "")).startswith("concurrent-"))
              for i in range(2)]
    assert sum(served) == 32 and min(served) >= 4, served


def _wait_idle(cluster: Cluster, i: int) -> spb.SchedulerLoad:
    def idle():
        load = cluster.worker_loads(i)
        return load if load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0 else None

    return wait_for(idle, 10, 0.02, what=f"worker {i} idle with all KV slots free")


def test_client_cancel_frees_kv_slots(cluster: Cluster, client: RouterClient) -> None:
    stream = client.generate("Once upon a time", max_new_tokens=220, temperature=0, ignore_eos=True)
    got = [next(stream) for _ in range(3)]
    assert all(d.finish is None for d in got)
    busy = [cluster.worker_loads(i) for i in range(2)]
    # (>= 1: the router's idle-worker HealthCheck may be running a one-token probe on the other one)
    assert sum(b.num_running_reqs + b.num_waiting_reqs for b in busy) >= 1
    assert sum(b.num_used_tokens for b in busy) > 0
    stream.close()  # cancels the call
    for i in range(2):
        load = _wait_idle(cluster, i)
        assert load.max_total_num_tokens == ENGINE["max_total_tokens"]


def test_deadline_aborts_on_worker(cluster: Cluster, client: RouterClient) -> None:
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("Once upon a time", max_new_tokens=235, temperature=0, ignore_eos=True, timeout=0.15))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for i in range(2):
        _wait_idle(cluster, i)


def _stop_case(deltas) -> tuple[str, str]:
    """A stop string made of the end of one delta and the start of the next (so it spans a token
    boundary), and the text the router must return before it."""
    full = "".join(d.text for d in deltas)
    pos = 0
    for a, b in zip(deltas, deltas[1:], strict=False):
        pos += len(a.text)
        ok = a.text.strip() and b.text.strip() and "\ufffd" not in a.text + b.text and len(a.text) + len(b.text) >= 3
        stop = a.text[-2:] + b.text[:2]
        if ok and pos > 4 and full.find(stop) == pos - len(a.text[-2:]):  # its first occurrence spans the boundary
            return stop, full[: full.find(stop)]
    raise AssertionError(f"no usable token boundary in {[d.text for d in deltas]}")


def test_stop_string_spanning_token_boundaries(cluster: Cluster, client: RouterClient, tok: ModelTokenizer) -> None:
    prompt = "The quick brown fox"
    deltas = list(client.generate(prompt, max_new_tokens=48, temperature=0, ignore_eos=True))
    stop, before = _stop_case(deltas[:-1])
    args = dict(max_new_tokens=200, temperature=0, ignore_eos=True)
    out = list(client.generate(prompt, stop=[stop], request_id="stop-span", **args))
    (c,) = collect(out)
    assert c.text == before and c.finish.reason == "stop" and c.finish.stop_str == stop
    assert stop not in "".join(d.text for d in out)
    assert tok.decode(c.token_ids, skip_special_tokens=True).startswith(before + stop)
    assert c.finish.completion_tokens == len(c.token_ids) < 48
    (kept,) = collect(client.generate(prompt, stop=[stop], include_stop_str_in_output=True, **args))
    assert kept.text == before + stop
    # The worker was told to stop: nothing keeps running toward max_new_tokens=200.
    for i in range(2):
        _wait_idle(cluster, i)
    # The worker knows the call by the engine id the router minted; the client's id is a label.
    records = [r for w in cluster.workers for r in w.log_records()]
    engine_ids = {r["request_id"] for r in records if r.get("client_request_id") == "stop-span"}
    assert engine_ids and "stop-span" not in engine_ids
    assert any(r.get("event") == "abort" and r.get("request_id") in engine_ids for r in records)


def test_request_id_reaches_every_log_line(cluster: Cluster, client: RouterClient) -> None:
    (c,) = collect(client.generate("Hello", max_new_tokens=4, metadata=[("x-request-id", "rid-from-metadata")]))
    assert c.request_id == "rid-from-metadata"
    router_lines = [r for r in cluster.router.log_records() if r.get("request_id") == "rid-from-metadata"]
    assert {"generate routed", "generate finished"} <= {r["event"] for r in router_lines}
    worker_lines = [r for w in cluster.workers for r in w.log_records()
                    if r.get("client_request_id") == "rid-from-metadata"]
    assert {"generate accepted", "generate finished"} <= {r["event"] for r in worker_lines}
    (generated,) = collect(client.generate("Hello", max_new_tokens=2))
    assert len(generated.request_id) == 32  # assigned by the router


# ---- bad input -----------------------------------------------------------------------------------

BAD = [
    # (name, rpc, request, code, text the message must contain)
    ("empty text", "Generate", pb.GenerateRequest(text=""), "INVALID_ARGUMENT", "text"),
    ("no prompt", "Generate", pb.GenerateRequest(), "INVALID_ARGUMENT", "prompt"),
    ("empty ids", "Generate", pb.GenerateRequest(token_ids=pb.TokenIds()), "INVALID_ARGUMENT", "token_ids"),
    ("id outside vocab", "Generate", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 600])), "INVALID_ARGUMENT",
     "token_ids"),
    ("max_new_tokens beyond context", "Generate",
     pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_new_tokens=CONTEXT + 1)),
     "INVALID_ARGUMENT", "max_new_tokens"),
    ("temperature < 0", "Generate", pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(temperature=-1)),
     "INVALID_ARGUMENT", "temperature"),
    ("top_p > 1", "Generate", pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(top_p=1.5)),
     "INVALID_ARGUMENT", "top_p"),
    ("top_p < 0", "Generate", pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(top_p=-0.2)),
     "INVALID_ARGUMENT", "top_p"),
    ("top_k < -1", "Generate", pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(top_k=-2)),
     "INVALID_ARGUMENT", "top_k"),
    ("stop id outside vocab", "Generate",
     pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(stop_token_ids=[512])),
     "INVALID_ARGUMENT", "stop_token_ids"),
    ("empty stop string", "Generate", pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(stop=[""])),
     "INVALID_ARGUMENT", "stop"),
    ("min above max", "Generate",
     pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_new_tokens=2, min_new_tokens=3)),
     "INVALID_ARGUMENT", "min_new_tokens"),
    ("n beyond the worker's limit", "Generate",
     pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(n=1000, max_new_tokens=2)),
     "INVALID_ARGUMENT", "n"),
    ("unknown model", "Generate", pb.GenerateRequest(text="hi", model="no-such-model"), "INVALID_ARGUMENT", "model"),
    ("max_new_tokens zero", "Generate",
     pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_new_tokens=0)),
     "INVALID_ARGUMENT", "max_new_tokens"),
    ("max_new_tokens negative", "Generate",
     pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_new_tokens=-4)),
     "INVALID_ARGUMENT", "max_new_tokens"),
    ("n zero", "Generate", pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(n=0)),
     "INVALID_ARGUMENT", "sampling_params.n"),
    ("prompt never fits", "Generate", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * CONTEXT)),
     "RESOURCE_EXHAUSTED", "token_ids"),
    ("prompt + max_new_tokens never fit", "Generate",
     pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 200), sampling_params=pb.SamplingParams(max_new_tokens=100)),
     "RESOURCE_EXHAUSTED", "max_new_tokens"),
    ("empty conversation", "Chat", pb.ChatRequest(), "INVALID_ARGUMENT", "messages"),
    ("empty role", "Chat", pb.ChatRequest(messages=[{"role": "", "content": "x"}]), "INVALID_ARGUMENT",
     "messages[0].role"),
    ("chat temperature", "Chat", pb.ChatRequest(messages=[{"role": "user", "content": "x"}],
                                                sampling_params=pb.SamplingParams(temperature=-3)),
     "INVALID_ARGUMENT", "temperature"),
]


def test_bad_input_is_rejected_while_serving(cluster: Cluster, client: RouterClient, tok: ModelTokenizer,
                                             reference) -> None:
    prompt = PROMPTS[3]
    want = reference(tok.encode(prompt), 120)
    result: dict = {}

    def background() -> None:
        result["c"] = collect(client.generate(prompt, max_new_tokens=120, temperature=0, ignore_eos=True))[0]

    thread = threading.Thread(target=background)
    thread.start()
    with grpc.insecure_channel(cluster.address) as ch:
        stub = pb_grpc.RouterStub(ch)
        for name, rpc, request, code, needle in BAD:
            with pytest.raises(grpc.RpcError) as e:
                list(getattr(stub, rpc)(request, timeout=TIMEOUT))
            assert e.value.code().name == code, (name, e.value.code(), e.value.details())
            assert needle in e.value.details(), (name, e.value.details())
    thread.join(TIMEOUT)
    assert result["c"].token_ids == want and result["c"].finish.reason == "length"


def _raw_call(address: str, method: str, payload: bytes):
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream(f"/llmserve.v1.Router/{method}", request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
        return list(call(payload, timeout=TIMEOUT))


@pytest.mark.parametrize("method, good, replace, field_name", [
    ("Generate", pb.GenerateRequest(text="caf\u00e9 ok"), ("caf\u00e9".encode(), b"caf\xe9"), "text"),
    ("Generate", pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(stop=["a", "zz"])),
     (b"zz", b"\xc3("), "sampling_params.stop[1]"),
    ("Chat", pb.ChatRequest(messages=[{"role": "user", "content": "hello"}]), (b"hello", b"he\xffo!"),
     "messages[0].content"),
])
def test_invalid_utf8_on_the_wire_is_invalid_argument(cluster: Cluster, client: RouterClient, method: str,
                                                      good, replace, field_name: str) -> None:
    raw = good.SerializeToString()
    assert replace[0] in raw
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(cluster.address, method, raw.replace(*replace))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert e.value.details().startswith(f"{field_name}:") and "UTF-8" in e.value.details()
    assert _health(cluster.address) == SERVING
    assert collect(client.generate("still fine", max_new_tokens=2))[0].finish.reason == "length"


def test_repeated_prompt_reports_the_workers_prefix_cache(client: RouterClient, reference) -> None:
    """Three calls with one long prompt over two worker groups: two of them land on one group, and the
    later of those finds all but the prompt's last token in that worker's radix cache; the router
    passes cached_tokens through in usage, and the tokens stay the engine's."""
    prompt = " ".join(PROMPTS * 2)
    ids = client.tokenize(prompt)
    assert 100 < len(ids) < CONTEXT - 8
    finishes = []
    for _ in range(3):
        (c,) = collect(list(client.generate(prompt, max_new_tokens=8, temperature=0, ignore_eos=True)))
        assert c.token_ids == reference(ids, 8)
        assert c.finish is not None and c.finish.prompt_tokens == len(ids)
        finishes.append(c.finish.cached_tokens)
    assert len(ids) - 1 in finishes, finishes


# ---- failures (keep last: this kills the module's workers) ---------------------------------------


def test_killing_worker_groups(cluster: Cluster, client: RouterClient, tok: ModelTokenizer, reference) -> None:
    want = {p: reference(tok.encode(p), 8) for p in PROMPTS}
    cluster.workers[1].proc.send_signal(signal.SIGKILL)
    cluster.workers[1].proc.wait(10)

    async def burst() -> list:
        async with AsyncRouterClient(cluster.address, timeout=TIMEOUT) as ac:
            return await asyncio.gather(*(ac.complete(p, max_new_tokens=8, temperature=0, ignore_eos=True)
                                          for p in PROMPTS))

    # Requests right after the kill: routed to group 0, or retried there when they hit group 1
    # before a probe noticed.
    for prompt, (c,) in zip(PROMPTS, asyncio.run(burst()), strict=False):
        assert c.token_ids == want[prompt] and c.finish.reason == "length"
    health = [pb.WORKER_HEALTH_SERVING, pb.WORKER_HEALTH_NOT_SERVING]
    wait_for(lambda: [g.health for g in client.list_workers().groups] == health, what="group 1 NOT_SERVING")
    assert _health(cluster.address) == SERVING
    (c,) = collect(client.generate(PROMPTS[0], max_new_tokens=8, temperature=0, ignore_eos=True))
    assert c.token_ids == want[PROMPTS[0]]

    cluster.workers[0].proc.send_signal(signal.SIGKILL)
    cluster.workers[0].proc.wait(10)
    wait_for(lambda: _health(cluster.address) == NOT_SERVING, what="router NOT_SERVING")
    assert [g.health for g in client.list_workers().groups] == [pb.WORKER_HEALTH_NOT_SERVING] * 2
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("anyone?", max_new_tokens=4))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy worker group" in e.value.details()
    assert client.tokenize("still tokenizes") == tok.encode("still tokenizes")
