"""The bad-input matrix of docs/reliability.md, against a real cluster on loopback (tokenizer service,
one worker, the router, as processes): every case gets its expected status code with the field at
fault named at the start of the message, within 2 s, never UNKNOWN or INTERNAL, and a normal request
to the same service succeeds right after it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as spb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as spb_grpc

from llmserve.v1 import router_pb2 as pb
from llmserve.v1 import tokenizer_pb2 as tpb
from router.client import RouterClient, generate_request
from tests.integration.test_router import one_group_cluster

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
VOCAB, CONTEXT = 512, 256  # the tiny preset under test_router's ENGINE settings


@dataclass
class Endpoints:
    router: str
    worker: str


@pytest.fixture(scope="module")
def endpoints(model_factory, tmp_path_factory) -> Iterator[Endpoints]:
    with one_group_cluster(model_factory("tiny"), tmp_path_factory.mktemp("matrix")) as (_, worker, router):
        yield Endpoints(router.address, worker.address)


def _gen(**sampling) -> pb.GenerateRequest:
    return generate_request("Hello there", **sampling)


def _chat(messages, **kw) -> pb.ChatRequest:
    return pb.ChatRequest(messages=[tpb.ChatMessage(role=r, content=c) for r, c in messages], **kw)


def _worker(ids=(1, 2, 3), max_new: int | None = 4, rid: str = "", **sampling) -> spb.GenerateRequest:
    sp = spb.SamplingParams(**{"temperature": 0.0, **sampling})
    if max_new is not None:
        sp.max_new_tokens = max_new
    return spb.GenerateRequest(request_id=rid, tokenized=spb.TokenizedInput(input_ids=list(ids)), sampling_params=sp)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (for messages protobuf itself refuses to build)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


BAD_UTF8 = b"\xff\xfe"

# (name, service, method, request or raw bytes, expected code, field that must start the message)
CASES = [
    ("max_new_tokens 0", "router", "Generate", _gen(max_new_tokens=0), INVALID, "sampling_params.max_new_tokens"),
    ("max_new_tokens -1", "router", "Generate", _gen(max_new_tokens=-1), INVALID, "sampling_params.max_new_tokens"),
    ("max_new_tokens 2^31-1", "router", "Generate", _gen(max_new_tokens=2**31 - 1), INVALID,
     "sampling_params.max_new_tokens"),
    ("prompt + max_new_tokens > context", "router", "Generate", _gen(max_new_tokens=CONTEXT - 1), EXHAUSTED,
     "sampling_params.max_new_tokens"),
    ("temperature -1", "router", "Generate", _gen(temperature=-1.0), INVALID, "sampling_params.temperature"),
    ("temperature nan", "router", "Generate", _gen(temperature=float("nan")), INVALID, "sampling_params.temperature"),
    ("top_p 1.5", "router", "Generate", _gen(top_p=1.5), INVALID, "sampling_params.top_p"),
    ("top_p nan", "router", "Generate", _gen(top_p=float("nan")), INVALID, "sampling_params.top_p"),
    ("top_k -2", "router", "Generate", _gen(top_k=-2), INVALID, "sampling_params.top_k"),
    ("min_p 2", "router", "Generate", _gen(min_p=2.0), INVALID, "sampling_params.min_p"),
    ("frequency_penalty 3", "router", "Generate", _gen(frequency_penalty=3.0), INVALID,
     "sampling_params.frequency_penalty"),
    ("presence_penalty -inf", "router", "Generate", _gen(presence_penalty=float("-inf")), INVALID,
     "sampling_params.presence_penalty"),
    ("repetition_penalty -1", "router", "Generate", _gen(repetition_penalty=-1.0), INVALID,
     "sampling_params.repetition_penalty"),
    ("min_new_tokens > max_new_tokens", "router", "Generate", _gen(min_new_tokens=8, max_new_tokens=4), INVALID,
     "sampling_params.min_new_tokens"),
    ("n 0", "router", "Generate", _gen(n=0), INVALID, "sampling_params.n"),
    ("n 2^31-1", "router", "Generate", _gen(n=2**31 - 1), INVALID, "sampling_params.n"),
    ("no prompt", "router", "Generate", pb.GenerateRequest(), INVALID, "prompt"),
    ("empty text", "router", "Generate", pb.GenerateRequest(text=""), INVALID, "text"),
    ("empty token_ids", "router", "Generate", pb.GenerateRequest(token_ids=pb.TokenIds()), INVALID, "token_ids.ids"),
    ("token id outside the vocabulary", "router", "Generate", generate_request([1, VOCAB]), INVALID, "token_ids.ids"),
    ("100k prompt tokens", "router", "Generate", generate_request([1] * 100_000), EXHAUSTED, "token_ids"),
    ("stop_token_ids outside the vocabulary", "router", "Generate", _gen(stop_token_ids=[9999]), INVALID,
     "sampling_params.stop_token_ids[0]"),
    ("empty stop string", "router", "Generate", _gen(stop=["ok", ""]), INVALID, "sampling_params.stop[1]"),
    ("17 stop strings", "router", "Generate", _gen(stop=["s"] * 17), INVALID, "sampling_params.stop"),
    ("stop string of 1 MB", "router", "Generate", _gen(stop=["x" * 1_000_000]), INVALID, "sampling_params.stop[0]"),
    ("top_logprobs 21", "router", "Generate", _gen(top_logprobs=21), INVALID, "sampling_params.top_logprobs"),
    ("unknown model", "router", "Generate", generate_request("hi", model="gpt-9"), INVALID, "model"),
    ("model of 1 MB", "router", "Generate", generate_request("hi", model="m" * 1_000_000), INVALID, "model"),
    ("request_id with a newline", "router", "Generate", generate_request("hi", request_id="a\nb"), INVALID,
     "request_id"),
    ("request_id non-ASCII", "router", "Generate", generate_request("hi", request_id="caf\u00e9"), INVALID,
     "request_id"),
    ("request_id of 100 KB", "router", "Generate", generate_request("hi", request_id="r" * 100_000), INVALID,
     "request_id"),
    ("invalid UTF-8 text", "router", "Generate", _field(2, BAD_UTF8), INVALID, "text"),
    ("garbage bytes", "router", "Generate", b"\x0a\xff\xff\xff\xff\x0f", INVALID, "request"),
    ("chat: no messages", "router", "Chat", _chat([]), INVALID, "messages"),
    ("chat: empty role", "router", "Chat", _chat([("", "hi")]), INVALID, "messages[0].role"),
    ("chat: 5000 messages", "router", "Chat", _chat([("user", "hi")] * 5000), INVALID, "messages"),
    ("chat: invalid UTF-8 content", "router", "Chat", _field(2, _field(1, b"user") + _field(2, BAD_UTF8)), INVALID,
     "messages[0].content"),
    ("chat: n 0", "router", "Chat", _chat([("user", "hi")], sampling_params=pb.SamplingParams(n=0)), INVALID,
     "sampling_params.n"),
    ("tokenize: no input", "router", "Tokenize", pb.TokenizeRequest(), INVALID, "input"),
    ("tokenize: empty chat", "router", "Tokenize", pb.TokenizeRequest(chat=tpb.Conversation()), INVALID,
     "chat.messages"),
    ("tokenize: unknown model", "router", "Tokenize", pb.TokenizeRequest(text="hi", model="nope"), INVALID, "model"),
    ("detokenize: id outside the vocabulary", "router", "Detokenize", pb.DetokenizeRequest(token_ids=[1, VOCAB]),
     INVALID, "token_ids"),
    ("detokenize: unknown model", "router", "Detokenize", pb.DetokenizeRequest(token_ids=[1], model="x"), INVALID,
     "model"),
    ("worker: no input ids", "worker", "Generate", _worker(ids=()), INVALID, "input_ids"),
    ("worker: id outside the vocabulary", "worker", "Generate", _worker(ids=(1, VOCAB)), INVALID, "input_ids"),
    ("worker: 100k ids", "worker", "Generate", _worker(ids=[1] * 100_000), EXHAUSTED, "input_ids"),
    ("worker: max_new_tokens 0", "worker", "Generate", _worker(max_new=0), INVALID, "max_new_tokens"),
    ("worker: temperature nan", "worker", "Generate", _worker(temperature=float("nan")), INVALID, "temperature"),
    ("worker: top_p 2", "worker", "Generate", _worker(top_p=2.0), INVALID, "top_p"),
    ("worker: n 2^31-1", "worker", "Generate", _worker(n=2**31 - 1), INVALID, "n"),
    ("worker: regex", "worker", "Generate", _worker(regex="a+"), INVALID, "regex"),
    ("worker: invalid UTF-8 request_id", "worker", "Generate", _field(1, BAD_UTF8) + _field(2, _field(2, b"\x01\x02")),
     INVALID, "request_id"),
    ("worker: garbage bytes", "worker", "Generate", b"\x12\xff\xff\xff\xff\x0f", INVALID, "request"),
]

SERVICES = {"router": "llmserve.v1.Router", "worker": "sglang.grpc.scheduler.SglangScheduler"}
STREAMING = {"Generate", "Chat"}


def _call(address: str, service: str, method: str, request) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        path = f"/{SERVICES[service]}/{method}"
        serialize = (lambda b: b) if isinstance(request, bytes) else (lambda m: m.SerializeToString())
        try:
            if method in STREAMING:
                for _ in ch.unary_stream(path, request_serializer=serialize, response_deserializer=bytes)(request,
                                                                                                           timeout=10):
                    pass
            else:
                ch.unary_unary(path, request_serializer=serialize, response_deserializer=bytes)(request, timeout=10)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _normal_request_succeeds(endpoints: Endpoints, service: str) -> None:
    if service == "router":
        with RouterClient(endpoints.router, timeout=10) as client:
            (c,) = client.complete("Hello", max_new_tokens=2)
            assert c.finish.reason in ("length", "stop")
    else:
        with grpc.insecure_channel(endpoints.worker) as ch:
            responses = list(spb_grpc.SglangSchedulerStub(ch).Generate(_worker(), timeout=10))
            assert responses[-1].WhichOneof("response") == "complete"


def test_matrix_has_forty_cases_over_every_rpc() -> None:
    assert len(CASES) >= 40
    assert {(s, m) for _, s, m, *_ in CASES} >= {("router", "Generate"), ("router", "Chat"), ("router", "Tokenize"),
                                                ("router", "Detokenize"), ("worker", "Generate")}


@pytest.mark.parametrize("name,service,method,request_,code,field", CASES, ids=[c[0] for c in CASES])
def test_bad_input(endpoints: Endpoints, name, service, method, request_, code, field) -> None:
    address = endpoints.router if service == "router" else endpoints.worker
    start = time.monotonic()
    got, details = _call(address, service, method, request_)
    seconds = time.monotonic() - start
    assert got not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), details
    assert got == code, f"{name}: {got.name} {details}"
    assert details.startswith(field), f"{name}: {details!r} does not name {field}"
    assert len(details) < 1000  # client strings are not echoed whole
    assert seconds < 2.0, f"{name} took {seconds:.2f}s"
    _normal_request_succeeds(endpoints, service)
