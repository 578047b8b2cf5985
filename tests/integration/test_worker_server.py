"""The model worker over real gRPC on 127.0.0.1: sglang.grpc.scheduler.SglangScheduler and
grpc.health.v1 against an in-process engine with the same settings (tiny model, fp32, 512-token KV
pool, 256-token context)."""

from __future__ import annotations

import hashlib
import io
import json
import random
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import structlog
import torch
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2
from tokenizers import Tokenizer

from tests.integration.conftest import WORKER_ENGINE, worker_engine_config
from worker_svc.engine.engine import Engine
from worker_svc.engine.request import FinishReason
from worker_svc.sampling import SamplingParams
from worker_svc.server import convert as grpc_convert
from worker_svc.server.app import ServerThread, WorkerServer
from worker_svc.server.servicer import SERVICE_NAME

VOCAB = 512  # tiny preset; ids 507.. are special tokens
POOL = WORKER_ENGINE["max_total_tokens"]
CONTEXT = WORKER_ENGINE["context_length"]
TIMEOUT = 60  # seconds, per RPC


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


def _request(ids, *, rid: str = "", stream: bool = False, max_new: int | None = 16, **kw) -> pb.GenerateRequest:
    top = {k: kw.pop(k) for k in ("return_logprob", "top_logprobs_num") if k in kw}
    sampling = pb.SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw})
    if max_new is not None:
        sampling.max_new_tokens = max_new
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=sampling, stream=stream, **top
    )


def _collect(stub, request, **kw) -> tuple[list[pb.GenerateStreamChunk], list[pb.GenerateComplete]]:
    chunks, completes = [], []
    for resp in stub.Generate(request, timeout=TIMEOUT, **kw):
        kind = resp.WhichOneof("response")
        (chunks if kind == "chunk" else completes).append(getattr(resp, kind))
    return chunks, completes


def _greedy(engine: Engine, prompt: list[int], max_new: int = 16, **kw) -> list[int]:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)
    (result,) = engine.generate([prompt], params)
    return result.output_ids


def _wait_idle(stub, timeout: float = 15.0) -> pb.SchedulerLoad:
    """Poll GetLoads until nothing runs or waits and every KV slot is free."""
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT).loads[0]
        if load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0:
            assert load.max_total_num_tokens == POOL
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"worker not idle after {timeout}s: {load}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def channel(inproc_worker):
    with grpc.insecure_channel(inproc_worker.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.SglangSchedulerStub:
    return pb_grpc.SglangSchedulerStub(channel)


@pytest.fixture
def finished(inproc_worker, monkeypatch) -> list[tuple[str, FinishReason]]:
    """(engine rid, finish reason) of every request the engine finishes during the test. The worker
    mints engine ids ``<request_id>#<seq>`` (worker_svc/server/calls.py)."""
    records: list[tuple[str, FinishReason]] = []
    loop = inproc_worker.server.loop
    dispatch = loop._dispatch

    def spy(outputs):
        records.extend((o.rid, o.finish_reason) for o in outputs if o.finished)
        dispatch(outputs)

    monkeypatch.setattr(loop, "_dispatch", spy)
    return records


@pytest.fixture
def slow_steps(inproc_worker, monkeypatch) -> None:
    """Every engine step takes at least 10 ms, so a long generation is surely still running when a
    test cancels or aborts it, however fast the machine."""
    scheduler = inproc_worker.server.loop.scheduler
    step = scheduler.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(scheduler, "step", slow_step)


# ---- Generate ------------------------------------------------------------------------------------


def test_greedy_matches_in_process_engine(stub, reference_engine):
    for i, length in enumerate((1, 7, 40, 150)):  # 150 > chunked_prefill_size: a chunked prefill
        prompt = _prompt(length, seed=i)
        chunks, (done,) = _collect(stub, _request(prompt, rid=f"greedy-{i}"))
        assert chunks == []  # not streaming: one GenerateComplete only
        assert list(done.output_ids) == _greedy(reference_engine, prompt)
        assert (done.finish_reason, done.prompt_tokens, done.completion_tokens, done.index) == ("length", length, 16, 0)
        assert done.WhichOneof("matched_stop") is None


def test_stream_chunks_concatenate_to_the_output(stub, reference_engine):
    prompt = _prompt(12, seed=11)
    chunks, (done,) = _collect(stub, _request(prompt, rid="stream-1", stream=True, max_new=20))
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == list(done.output_ids) == _greedy(reference_engine, prompt, max_new=20)
    assert [c.completion_tokens for c in chunks] == list(range(1, 21))  # cumulative counts
    assert all(c.prompt_tokens == 12 and c.index == 0 for c in chunks)
    assert done.completion_tokens == 20


def test_proto_zero_values_are_not_semantic(stub, reference_engine):
    """temperature 0 = greedy, top_p 0 = 1, top_k 0 = off, n 0 = 1, repetition_penalty 0 = off, and
    no max_new_tokens = whatever room the context leaves."""
    prompt = _prompt(8, seed=12)
    request = _request(prompt, rid="zeros", max_new=None, top_p=0.0, top_k=0, n=0, repetition_penalty=0.0)
    assert not request.sampling_params.HasField("max_new_tokens")
    _, (done,) = _collect(stub, request)
    assert done.finish_reason == "length"
    assert done.completion_tokens == CONTEXT - len(prompt)
    assert list(done.output_ids) == _greedy(reference_engine, prompt, max_new=CONTEXT - len(prompt))


def test_n2_gives_one_complete_per_index(stub, reference_engine):
    prompt = _prompt(9, seed=13)
    expected = _greedy(reference_engine, prompt)
    chunks, completes = _collect(stub, _request(prompt, rid="n2", stream=True, n=2))
    assert sorted(c.index for c in completes) == [0, 1]
    for done in completes:
        assert list(done.output_ids) == expected
        assert [t for c in chunks if c.index == done.index for t in c.token_ids] == expected


def test_n2_seeded_sampling_uses_seed_plus_index(stub, reference_engine):
    """A seed in custom_params: sample i draws with seed + i, as the in-process engine does."""
    prompt = _prompt(6, seed=14)
    request = _request(prompt, rid="n2-seeded", n=2, temperature=5.0, top_p=0.9)
    request.sampling_params.custom_params.update({"seed": 1234})
    _, completes = _collect(stub, request)
    by_index = {c.index: list(c.output_ids) for c in completes}
    params = SamplingParams(max_new_tokens=16, temperature=5.0, top_p=0.9, ignore_eos=True, seed=1234, n=2)
    ref = [r.output_ids for r in reference_engine.generate([prompt], params)]
    assert by_index == {0: ref[0], 1: ref[1]}
    assert ref[0] != ref[1]


def test_logprobs_and_top_logprobs(stub, reference_engine):
    prompt = _prompt(10, seed=15)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, return_logprob=True, top_logprobs_num=3)
    (ref,) = reference_engine.generate([prompt], params)
    chunks, (done,) = _collect(
        stub, _request(prompt, rid="logprobs", stream=True, max_new=8, return_logprob=True, top_logprobs_num=3)
    )
    lp = done.output_logprobs
    assert list(lp.token_ids) == list(done.output_ids) == ref.output_ids
    assert list(lp.token_logprobs) == pytest.approx(ref.logprobs, abs=1e-4)
    assert len(lp.top_logprobs) == 8
    for row, ref_row, token, token_lp in zip(lp.top_logprobs, ref.top_logprobs, lp.token_ids, lp.token_logprobs,
                                             strict=True):
        assert list(row.token_ids) == [t for t, _ in ref_row] and len(row.values) == 3
        assert row.token_ids[0] == token and row.values[0] == pytest.approx(token_lp)  # greedy: top-1
        assert list(row.values) == sorted(row.values, reverse=True)
    # Chunks carry the incremental logprobs; together they are the Complete's.
    assert [v for c in chunks for v in c.output_logprobs.token_logprobs] == list(lp.token_logprobs)
    assert [list(r.token_ids) for c in chunks for r in c.output_logprobs.top_logprobs] == [
        list(r.token_ids) for r in lp.top_logprobs
    ]
    # Without return_logprob, no logprobs are sent.
    _, (plain,) = _collect(stub, _request(prompt, rid="no-logprobs", max_new=4))
    assert not plain.HasField("output_logprobs")


def test_stop_token_id_finishes_with_stop_and_the_matched_token(stub, reference_engine):
    prompt = _prompt(8, seed=16)
    full = _greedy(reference_engine, prompt)
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    _, (done,) = _collect(stub, _request(prompt, rid="stop", stop_token_ids=[full[k]]))
    assert done.finish_reason == "stop"
    assert done.matched_token_id == full[k]
    assert list(done.output_ids) == full[: k + 1]


BAD_PARAMS = [
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=1.5)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("frequency_penalty", dict(frequency_penalty=3.0)),
    ("stop_token_ids", dict(stop_token_ids=[VOCAB + 5])),
    ("max_new_tokens", dict(max_new=0)),
    ("min_new_tokens", dict(min_new_tokens=40)),
    ("n", dict(n=WORKER_ENGINE["max_running_requests"] + 1)),
    ("top_logprobs_num", dict(return_logprob=True, top_logprobs_num=50)),
    ("regex", dict(regex="[a-z]+")),
]


@pytest.mark.parametrize("field,kw", BAD_PARAMS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_PARAMS)])
def test_invalid_parameters_are_invalid_argument_naming_the_field(stub, field, kw):
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub, _request(_prompt(5, seed=17), rid="bad", **kw))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()


@pytest.mark.parametrize("ids", [[], [1, 2, VOCAB]], ids=["empty", "out-of-vocab"])
def test_bad_input_ids_are_invalid_argument(stub, ids):
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub, _request(ids, rid="bad-ids"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("input_ids")


def test_prompt_that_can_never_fit_is_resource_exhausted_while_a_good_request_completes(stub, reference_engine):
    good_prompt = _prompt(20, seed=18)
    expected = _greedy(reference_engine, good_prompt, max_new=64)
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(_collect, stub, _request(good_prompt, rid="good", stream=True, max_new=64))
        with pytest.raises(grpc.RpcError) as too_long:
            _collect(stub, _request(_prompt(CONTEXT + 10, seed=19), rid="too-long"))
        with pytest.raises(grpc.RpcError) as too_much:
            _collect(stub, _request(_prompt(200, seed=20), rid="too-much", max_new=100))
        chunks, (done,) = good.result(TIMEOUT)
    assert too_long.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert too_long.value.details().startswith("input_ids")
    assert too_much.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert too_much.value.details().startswith("max_new_tokens")
    assert list(done.output_ids) == [t for c in chunks for t in c.token_ids] == expected


def test_client_cancel_mid_stream_aborts_and_frees_kv(stub, finished, slow_steps):
    call = stub.Generate(_request(_prompt(8, seed=21), rid="cancel-me", stream=True, max_new=200), timeout=TIMEOUT)
    stream = iter(call)
    next(stream), next(stream)
    call.cancel()
    load = _wait_idle(stub)
    assert load.num_total_reqs == 0
    assert [reason for engine_id, reason in finished if engine_id.startswith("cancel-me#")] == [FinishReason.ABORT]


def test_deadline_aborts_the_engine_request(stub, finished, slow_steps):
    received = 0
    with pytest.raises(grpc.RpcError) as err:
        for _ in stub.Generate(_request(_prompt(8, seed=22), rid="deadline", stream=True, max_new=230), timeout=1.0):
            received += 1
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < received < 230
    _wait_idle(stub)
    assert [reason for engine_id, reason in finished if engine_id.startswith("deadline#")] == [FinishReason.ABORT]


def test_abort_rpc(stub, slow_steps):
    call = stub.Generate(_request(_prompt(8, seed=23), rid="abort-me", stream=True, n=2, max_new=200), timeout=TIMEOUT)
    stream = iter(call)
    next(stream)
    response = stub.Abort(pb.AbortRequest(request_id="abort-me", reason="test"), timeout=TIMEOUT)
    assert response.success
    completes = [r.complete for r in stream if r.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1]
    assert all(c.finish_reason == "abort" and 0 < c.completion_tokens < 200 for c in completes)
    _wait_idle(stub)
    assert not stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=TIMEOUT).success


def test_request_id_from_metadata_is_bound_into_every_log_line(stub):
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        _collect(stub, _request(_prompt(4, seed=24), max_new=2), metadata=(("x-request-id", "hdr-42"),))
    events = {e["event"] for e in logs if e.get("request_id") == "hdr-42"}
    assert {"generate accepted", "generate finished"} <= events


# ---- health, info, loads, tokenizer --------------------------------------------------------------


def test_health(stub, channel):
    response = stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT)  # runs a 1-token generation
    assert response.healthy, response.message
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    _wait_idle(stub)


def test_model_info(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.model_path == "" and info.tokenizer_path == ""  # or a gateway tries a model hub
    assert info.served_model_name == "tiny-test"
    assert info.is_generation and not info.supports_vision
    assert (info.vocab_size, info.max_context_length, info.max_req_input_len) == (VOCAB, CONTEXT, CONTEXT - 1)
    assert list(info.eos_token_ids) == [508, 511]  # config.json + generation_config.json
    assert info.bos_token_id == 507
    assert info.model_type == "llama" and list(info.architectures) == ["LlamaForCausalLM"]


def test_server_info(stub):
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert info.max_total_num_tokens == POOL and info.server_type == "grpc"
    assert info.sglang_version.startswith("llmserve-")
    sched = json_format.MessageToDict(info.scheduler_info)
    # 2 layers x 2 KV heads x head_dim 16 x (K and V) x 4 bytes
    assert sched["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 4
    assert sched["kv_cache_bytes"] >= POOL * sched["kv_bytes_per_token"]
    assert sched["weight_bytes"] > 0 and sched["dtype"] == "float32"
    assert sched["max_running_requests"] == WORKER_ENGINE["max_running_requests"]
    # The start-up kernel plan (executor/kernel_choice.py), as the log has it.
    kernels = sched["kernels"]
    assert kernels["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert kernels["attention"] == "torch_native" and kernels["bf16_linear"] == "aten"  # an fp32 model
    assert kernels["rms_norm"] in ("avx2", "torch") and "deterministic" not in kernels
    assert sched["fused_layers"].startswith("off: dtype torch.float32") or sched["fused_layers"].startswith("off: this")
    args = json_format.MessageToDict(info.server_args)
    assert args["model_path"] == "" and args["tp_size"] == 1
    assert args["chunked_prefill_size"] == WORKER_ENGINE["chunked_prefill_size"]
    assert info.uptime_seconds > 0 and info.start_time.seconds > 0


def test_loads_when_idle(stub):
    _wait_idle(stub)
    response = stub.GetLoads(pb.GetLoadsRequest(include=["all"]), timeout=TIMEOUT)
    assert response.dp_rank_count == 1 and response.timestamp
    (load,) = response.loads
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_used_tokens, load.token_usage) == (0, 0, 0, 0.0)
    assert load.max_total_num_tokens == POOL and load.max_running_requests == WORKER_ENGINE["max_running_requests"]
    assert load.memory.token_capacity == POOL and load.memory.weight_gb > 0
    assert load.HasField("queues")
    assert not stub.GetLoads(pb.GetLoadsRequest(dp_rank=1), timeout=TIMEOUT).loads  # one rank only


# ---- radix prefix cache -------------------------------------------------------------------------


def _cache_tokens(stub) -> int:
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT)
    return int(json_format.MessageToDict(info.scheduler_info)["radix_cache_tokens"])


def test_repeated_prompt_reports_cached_tokens_and_flush_cache_empties_the_cache(stub, reference_engine):
    """The second call with the same 200-token prompt finds 199 of them cached (usage cached_tokens,
    streamed and final) and gives the same tokens; FlushCache on the idle worker empties the cache."""
    prompt = _prompt(200, seed=40)
    expected = _greedy(reference_engine, prompt, max_new=8)
    _, (first,) = _collect(stub, _request(prompt, rid="cache-1", max_new=8))
    chunks, (second,) = _collect(stub, _request(prompt, rid="cache-2", max_new=8, stream=True))
    assert list(first.output_ids) == list(second.output_ids) == expected
    assert first.cached_tokens == 0 and first.prompt_tokens == 200
    assert second.cached_tokens == 199 and [c.cached_tokens for c in chunks] == [199] * len(chunks)
    load = _wait_idle(stub)  # cached prefixes count as free KV, as in sglang
    assert 0 < load.cache_hit_rate < 1
    assert _cache_tokens(stub) >= 200 + 8 - 1
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert json_format.MessageToDict(info.server_args)["disable_radix_cache"] is False
    assert json_format.MessageToDict(info.scheduler_info)["radix_cache"] is True
    flushed = stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT)
    assert flushed.success and flushed.message.startswith("flushed ")
    deadline = time.monotonic() + 10
    while _cache_tokens(stub):  # the load snapshot is taken after the step that flushed
        assert time.monotonic() < deadline, "radix_cache_tokens did not drop to 0 after FlushCache"
        time.sleep(0.02)
    _, (third,) = _collect(stub, _request(prompt, rid="cache-3", max_new=8))
    assert third.cached_tokens == 0 and list(third.output_ids) == expected


def test_flush_cache_is_refused_while_a_request_runs(stub, slow_steps):
    call = stub.Generate(_request(_prompt(8, seed=41), rid="flush-busy", stream=True, max_new=200), timeout=TIMEOUT)
    stream = iter(call)
    next(stream)
    refused = stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT)
    assert not refused.success and "running or waiting" in refused.message
    call.cancel()
    _wait_idle(stub)
    assert stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT).success


def test_worker_without_radix_cache(worker_model):
    """--disable-radix-cache (EngineConfig.disable_radix_cache): nothing is cached, FlushCache says so."""
    engine = Engine(worker_engine_config(worker_model, disable_radix_cache=True))
    thread = ServerThread(WorkerServer(engine, host="127.0.0.1", port=0))
    thread.start()
    try:
        with grpc.insecure_channel(thread.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            prompt = _prompt(100, seed=42)
            for rid in ("plain-1", "plain-2"):
                _, (done,) = _collect(stub, _request(prompt, rid=rid, max_new=4))
                assert done.cached_tokens == 0
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT)
            assert json_format.MessageToDict(info.server_args)["disable_radix_cache"] is True
            assert json_format.MessageToDict(info.scheduler_info)["radix_cache"] is False
            flushed = stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT)
            assert flushed.success and "disabled" in flushed.message
            with pytest.raises(grpc.RpcError) as err:  # no cache, no KV events (a gateway then stops asking)
                list(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "--disable-radix-cache" in err.value.details()
    finally:
        thread.stop(grace=0.5)


def test_get_tokenizer_zip_round_trips(stub, worker_model, tmp_path):
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT))
    assert chunks and chunks[-1].sha256 and all(not c.sha256 for c in chunks[:-1])
    data = b"".join(c.data for c in chunks)
    assert hashlib.sha256(data).hexdigest() == chunks[-1].sha256
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"} <= names
    for name in names:
        assert (tmp_path / name).read_bytes() == (worker_model / name).read_bytes()
    text = "Hello world, the tokenizer round trip."
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert ours.encode(text).ids == Tokenizer.from_file(str(worker_model / "tokenizer.json")).encode(text).ids
    assert "chat_template" in json.loads((tmp_path / "tokenizer_config.json").read_text())
    # Large bundles go in several chunks; only the last carries the fingerprint.
    parts = list(grpc_convert.tokenizer_chunks(data, chunks[-1].sha256, chunk_bytes=1000))
    assert len(parts) > 1 and b"".join(p.data for p in parts) == data
    assert [bool(p.sha256) for p in parts] == [False] * (len(parts) - 1) + [True]


# ---- failure and shutdown ------------------------------------------------------------------------


def test_engine_failure_fails_in_flight_requests_and_marks_not_serving(worker_model):
    server = WorkerServer(Engine(worker_engine_config(worker_model)), host="127.0.0.1", port=0)
    thread = ServerThread(server)
    thread.start()
    try:
        scheduler = server.loop.scheduler
        step = scheduler.step
        started = threading.Event()

        def failing_step():
            if started.is_set():
                raise RuntimeError("simulated device failure")
            return step()

        scheduler.step = failing_step
        with grpc.insecure_channel(thread.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)
            call = stub.Generate(_request(_prompt(8, seed=25), stream=True, max_new=200), timeout=TIMEOUT)
            stream = iter(call)
            next(stream)
            started.set()
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT).status == (
                health_pb2.HealthCheckResponse.NOT_SERVING
            )
            assert not stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT).healthy
            with pytest.raises(grpc.RpcError) as again:
                _collect(stub, _request(_prompt(4, seed=26)))
            assert again.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as flush:
                stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT)
            assert flush.value.code() == grpc.StatusCode.UNAVAILABLE and "engine is failed" in flush.value.details()
    finally:
        thread.stop(grace=0.5)


def test_worker_command_serves_and_exits_cleanly_on_sigterm(worker_model, worker_process_factory, reference_engine):
    worker = worker_process_factory(worker_model)
    prompt = _prompt(6, seed=27)
    with grpc.insecure_channel(worker.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        _, (done,) = _collect(pb_grpc.SglangSchedulerStub(ch), _request(prompt, rid="cli-1", max_new=8))
    assert list(done.output_ids) == _greedy(reference_engine, prompt, max_new=8)
    assert worker.terminate() == 0
    records = worker.log_records()
    assert any(r.get("event") == "generate finished" and r.get("request_id") == "cli-1" for r in records)
    assert any(r.get("event") == "worker stopped" for r in records)


def test_engine_loop_sleeps_when_idle_and_stops_gracefully(worker_model):
    """The loop thread blocks when there is nothing to do; stop() either lets in-flight requests
    finish or aborts them, joins, and refuses new ones."""
    import queue

    from worker_svc.engine.engine_loop import EngineLoop, EngineUnavailable, LoopState

    def run_one(abort_in_flight: bool, max_new: int):
        loop = EngineLoop(Engine(worker_engine_config(worker_model)))
        loop.start()
        time.sleep(0.1)
        assert loop.step_count == 0  # idle: no steps, no spinning
        outputs: queue.Queue = queue.Queue()
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
        loop.submit(_prompt(5, seed=30), params, "r", outputs.put)
        while outputs.empty():
            time.sleep(0.001)
        assert loop.stop(abort_in_flight=abort_in_flight, timeout=30)
        assert loop.state is LoopState.STOPPED
        with pytest.raises(EngineUnavailable):
            loop.submit([1], SamplingParams(max_new_tokens=1), "late", outputs.put)
        items = []
        while not outputs.empty():
            items.append(outputs.get())
        assert items[-1].finished and sum(len(o.new_token_ids) for o in items) == items[-1].completion_tokens
        assert loop.load().used_tokens == 0 and loop.load().in_flight == 0
        return items[-1]

    finished = run_one(abort_in_flight=False, max_new=40)
    assert finished.finish_reason is FinishReason.LENGTH and finished.completion_tokens == 40
    aborted = run_one(abort_in_flight=True, max_new=240)
    assert aborted.finish_reason is FinishReason.ABORT and aborted.completion_tokens < 240
