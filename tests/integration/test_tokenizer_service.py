"""llmserve.v1.Tokenizer over real gRPC on loopback: in-process server, and the CLI as a process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmserve.v1 import tokenizer_pb2 as pb
from llmserve.v1 import tokenizer_pb2_grpc as pb_grpc
from tokenizer_svc.server import start_server
from tokenizer_svc.tokenizer import ModelTokenizer

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 10.0


class _ServerThread:
    """A grpc.aio tokenizer server on its own event loop thread, for sync client tests."""

    def __init__(self, model: Path | ModelTokenizer):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = asyncio.run_coroutine_threadsafe(start_server(model, "127.0.0.1", 0), self.loop).result(30)
        self.port = self.running.port

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(grace=1.0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def tiny_dir(model_factory) -> Path:
    return model_factory("tiny")


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def channel(tiny_dir: Path) -> Iterator[grpc.Channel]:
    server = _ServerThread(tiny_dir)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=TIMEOUT)
        yield ch
    server.close()


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.TokenizerStub:
    return pb_grpc.TokenizerStub(channel)


def _invalid(call, request, field: str, code=grpc.StatusCode.INVALID_ARGUMENT) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call(request, timeout=TIMEOUT)
    assert e.value.code() == code, e.value
    assert field in e.value.details(), e.value.details()


def test_health(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "llmserve.v1.Tokenizer"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                         timeout=TIMEOUT)
    names = {s.name for s in reply.list_services_response.service}
    assert {"llmserve.v1.Tokenizer", "grpc.health.v1.Health"} <= names


def test_get_info(stub: pb_grpc.TokenizerStub, tok: ModelTokenizer) -> None:
    info = stub.GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT)
    assert info.vocab_size == 512 and info.HasField("bos_token_id") and info.bos_token_id == tok.bos_token_id
    assert list(info.eos_token_ids) == tok.eos_token_ids
    assert info.bos_token == "<|begin_of_text|>" and info.eos_token == "<|end_of_text|>"
    assert {t.id: t.content for t in info.special_tokens} == tok.special_tokens
    assert info.has_chat_template and "add_generation_prompt" in info.chat_template
    assert info.model_max_length == 2048


def test_encode_text(stub: pb_grpc.TokenizerStub, tok: ModelTokenizer) -> None:
    text = "Hello 世界 😀"
    reply = stub.Encode(pb.EncodeRequest(text=text), timeout=TIMEOUT)
    assert list(reply.token_ids) == tok.encode(text) and reply.token_ids[0] == tok.bos_token_id
    assert reply.prompt_text == text
    plain = stub.Encode(pb.EncodeRequest(text=text, add_special_tokens=False), timeout=TIMEOUT)
    assert list(plain.token_ids) == tok.encode(text, add_special_tokens=False)
    # An empty text is a valid input: BOS alone.
    assert list(stub.Encode(pb.EncodeRequest(text=""), timeout=TIMEOUT).token_ids) == [tok.bos_token_id]
    long_text = "lorem ipsum 中文 " * 2000  # takes the worker-thread path
    assert list(stub.Encode(pb.EncodeRequest(text=long_text), timeout=TIMEOUT).token_ids) == tok.encode(long_text)


def test_encode_chat(stub: pb_grpc.TokenizerStub, tok: ModelTokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ça va ? 😀"}]
    chat = pb.Conversation(messages=[pb.ChatMessage(**m) for m in messages], add_generation_prompt=True)
    reply = stub.Encode(pb.EncodeRequest(chat=chat), timeout=TIMEOUT)
    ids, text = tok.encode_chat(messages, add_generation_prompt=True)
    assert list(reply.token_ids) == ids and reply.prompt_text == text


def test_decode(stub: pb_grpc.TokenizerStub, tok: ModelTokenizer) -> None:
    ids = tok.encode("naïve café")
    assert stub.Decode(pb.DecodeRequest(token_ids=ids), timeout=TIMEOUT).text == "<|begin_of_text|>naïve café"
    reply = stub.Decode(pb.DecodeRequest(token_ids=ids, skip_special_tokens=True), timeout=TIMEOUT)
    assert reply.text == "naïve café"


def test_get_tokenizer_json_decodes_as_the_service(stub: pb_grpc.TokenizerStub, tok: ModelTokenizer) -> None:
    """What a router detokenizing in its own process loads: the same tokenizer, hash and range."""
    from tokenizers import Tokenizer

    resp = stub.GetTokenizerJson(pb.GetTokenizerJsonRequest(), timeout=TIMEOUT)
    assert resp.sha256 == hashlib.sha256(resp.tokenizer_json.encode()).hexdigest()
    assert resp.vocab_size == tok.vocab_size
    assert stub.GetTokenizerJson(pb.GetTokenizerJsonRequest(), timeout=TIMEOUT) == resp  # stable
    local = Tokenizer.from_str(resp.tokenizer_json)
    ids = tok.encode("Grüße, 世界! 👍🏽") + [next(iter(tok.special_tokens))]
    for skip in (False, True):
        served = stub.Decode(pb.DecodeRequest(token_ids=ids, skip_special_tokens=skip), timeout=TIMEOUT).text
        assert local.decode(ids, skip_special_tokens=skip) == served


def test_detokenize_stream_interleaved_sequences(stub: pb_grpc.TokenizerStub, tok: ModelTokenizer) -> None:
    texts = {0: "日本語の文章 and 中文", 1: "emoji 👨‍👩‍👧 🚀 done", 2: "short"}
    ids = {k: tok.encode(t, add_special_tokens=False) + [tok.eos_token_ids[-1]] for k, t in texts.items()}
    requests = []
    longest = max(len(v) for v in ids.values())
    for pos in range(longest):  # one id per message, sequences interleaved
        for sid, seq in ids.items():
            if pos < len(seq):
                requests.append(pb.DetokenizeStreamRequest(
                    sequence_id=sid, token_ids=[seq[pos]], final=pos == len(seq) - 1,
                    skip_special_tokens=sid != 2))
    requests.append(pb.DetokenizeStreamRequest(sequence_id=0, token_ids=ids[0][:3]))  # key reused after final
    requests.append(pb.DetokenizeStreamRequest(sequence_id=0, final=True))  # flush-only message
    replies = list(stub.DetokenizeStream(iter(requests), timeout=TIMEOUT))
    assert len(replies) == len(requests)  # exactly one reply per request, in order
    assert [r.sequence_id for r in replies] == [q.sequence_id for q in requests]
    assert [r.final for r in replies] == [q.final for q in requests]
    out: dict[int, list[str]] = {}
    for q, r in zip(requests, replies, strict=False):
        assert "\ufffd" not in r.text
        out.setdefault(q.sequence_id, []).append(r.text)
    n0 = len(ids[0])
    assert "".join(out[0][:n0]) == texts[0]  # eos skipped
    assert "".join(out[0][n0:]) == tok.decode(ids[0][:3], skip_special_tokens=True)
    assert "".join(out[1]) == texts[1]
    assert "".join(out[2]) == texts[2] + "<|eot_id|>"  # skip_special_tokens false
    assert replies[-1].num_tokens == 3


def test_detokenize_stream_context_ids(stub: pb_grpc.TokenizerStub, tok: ModelTokenizer) -> None:
    ids = tok.encode(" and then 雨", add_special_tokens=False)
    req = pb.DetokenizeStreamRequest(sequence_id=5, token_ids=ids, final=True,
                                     context_token_ids=tok.encode("It rained")[-3:])
    (reply,) = stub.DetokenizeStream(iter([req]), timeout=TIMEOUT)
    assert reply.text == " and then 雨" and reply.num_tokens == len(ids)


def test_invalid_arguments(stub: pb_grpc.TokenizerStub) -> None:
    _invalid(stub.Encode, pb.EncodeRequest(), "input")
    _invalid(stub.Encode, pb.EncodeRequest(chat=pb.Conversation()), "chat.messages")
    bad_role = pb.Conversation(messages=[pb.ChatMessage(role="user", content="a"), pb.ChatMessage(content="b")])
    _invalid(stub.Encode, pb.EncodeRequest(chat=bad_role), "chat.messages[1].role")
    _invalid(stub.Decode, pb.DecodeRequest(token_ids=[1, 2, 512]), "token_ids: id 512 at position 2")

    def stream(request, timeout):
        return list(stub.DetokenizeStream(iter(request), timeout=timeout))

    ok = pb.DetokenizeStreamRequest(sequence_id=1, token_ids=[65])
    _invalid(stream, [ok, pb.DetokenizeStreamRequest(sequence_id=7, token_ids=[70, 100000])],
             "token_ids (sequence_id 7): id 100000 at position 1")
    _invalid(stream, [pb.DetokenizeStreamRequest(sequence_id=2, context_token_ids=[999])],
             "context_token_ids (sequence_id 2)")


def test_chat_without_template_is_failed_precondition(tiny_dir: Path, tmp_path: Path) -> None:
    tok = ModelTokenizer.from_dir(tiny_dir)
    tok_no_template = ModelTokenizer(tok.tokenizer, {"bos_token": tok.bos_token}, chat_template=None)
    server = _ServerThread(tok_no_template)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            chat = pb.Conversation(messages=[pb.ChatMessage(role="user", content="hi")])
            _invalid(pb_grpc.TokenizerStub(ch).Encode, pb.EncodeRequest(chat=chat), "chat template",
                     code=grpc.StatusCode.FAILED_PRECONDITION)
    finally:
        server.close()


def test_cli_serves_logs_json_and_exits_zero_on_sigterm(tiny_dir: Path, tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", "tokenizer", "--model", str(tiny_dir), "--host", "127.0.0.1",
         "--port", "0", "--port-file", str(port_file), "--log-json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "tokenizer service did not start"
            time.sleep(0.05)
        port = int(port_file.read_text())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.TokenizerStub(ch)
            assert len(stub.Encode(pb.EncodeRequest(text="hi"), timeout=TIMEOUT).token_ids) >= 2
            with pytest.raises(grpc.RpcError):
                stub.Decode(pb.DecodeRequest(token_ids=[10**6]), timeout=TIMEOUT,
                            metadata=[("x-request-id", "req-42")])
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]  # every line is JSON
    events = {line["event"]: line for line in lines}
    assert events["tokenizer service listening"]["address"] == f"127.0.0.1:{port}"
    rejected = events["rejected"]
    assert rejected["request_id"] == "req-42" and rejected["rpc"] == "Decode"
    assert rejected["level"] == "info" and "timestamp" in rejected
    assert "tokenizer service stopping" in events


def test_messages_over_grpcs_default_4_mib_are_accepted(channel: grpc.Channel, tiny_dir: Path) -> None:
    """F8: the service kept grpc's 4 MiB receive limit while the router accepts 64 MiB, so a 5 MiB
    prompt came back as a retryable UNAVAILABLE from the router."""
    server = _ServerThread(tiny_dir)
    try:
        big = [300] * (5 << 19)  # 2.6M ids of two varint bytes each: a 5 MiB request
        with grpc.insecure_channel(f"127.0.0.1:{server.port}",
                                   options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
            resp = pb_grpc.TokenizerStub(ch).Decode(pb.DecodeRequest(token_ids=big), timeout=60)
        assert len(resp.text) >= len(big)
    finally:
        server.close()
