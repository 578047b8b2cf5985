"""Python client of llmserve.v1.Router, blocking and asyncio.

    from router.client import RouterClient
    with RouterClient("127.0.0.1:30000") as client:
        for delta in client.generate("Once upon a time", max_new_tokens=32, temperature=0):
            print(delta.text, end="", flush=True)
        print(client.generate_text("Hello", max_new_tokens=8, stop=["."]))
        for delta in client.chat([{"role": "user", "content": "Hi"}], max_new_tokens=16):
            ...

    async with AsyncRouterClient("127.0.0.1:30000") as client:
        async for delta in client.generate("Once upon a time", max_new_tokens=32):
            ...

A router serving TLS and requiring a token (llmserve/security.py):

    from llmserve.security import BearerToken, ChannelTls
    RouterClient("router.example:30000", tls=ChannelTls.from_files(ca="ca.pem"),   # or tls=True: system roots
                 token=BearerToken.from_file("client.token"))                     # or token="the-token"
    # mTLS: ChannelTls.from_files(ca="ca.pem", cert="client.pem", key="client.key")

Sampling keywords are the fields of router.proto's SamplingParams (max_new_tokens, temperature,
top_p, top_k, min_p, repetition_penalty, frequency_penalty, presence_penalty, seed, stop,
stop_token_ids, ignore_eos, n, logprobs, top_logprobs, include_stop_str_in_output,
skip_special_tokens, min_new_tokens); `stop` may be one string. Errors are raised as grpc.RpcError
(`.code()`, `.details()`). Leaving a `generate` loop early (break, exception, garbage collection)
cancels the call, which aborts the request on the worker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.grpc_server import REQUEST_ID_HEADER
from llmserve.security import BearerToken, ChannelSecurity, ChannelTls
from llmserve.v1 import router_pb2 as pb
from llmserve.v1 import router_pb2_grpc as pb_grpc
from llmserve.v1 import tokenizer_pb2 as tpb

_SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length" | "abort"
    stop_str: str | None
    stop_token_id: int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    message: str = ""


@dataclass(frozen=True)
class Delta:
    """One streamed message: new text and ids of sequence `index`; `finish` on its last one."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish: Finish | None
    request_id: str


@dataclass
class Completion:
    """A whole sequence, collected from its deltas."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finish | None = None
    request_id: str = ""


def sampling_params(**kwargs: Any) -> pb.SamplingParams:
    unknown = set(kwargs) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    values = {k: v for k, v in kwargs.items() if v is not None}
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    return pb.SamplingParams(**values)


def generate_request(prompt: str | Sequence[int], *, model: str = "", request_id: str = "",
                     add_special_tokens: bool | None = None, **sampling: Any) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=model, request_id=request_id, sampling_params=sampling_params(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req


Message = Mapping[str, str] | tuple[str, str] | tpb.ChatMessage


def _chat_message(m: Message) -> tpb.ChatMessage:
    if isinstance(m, tpb.ChatMessage):
        return m
    if isinstance(m, tuple):
        return tpb.ChatMessage(role=m[0], content=m[1])
    return tpb.ChatMessage(role=m["role"], content=m["content"])


def chat_request(messages: Iterable[Message], *, model: str = "", request_id: str = "",
                 add_generation_prompt: bool | None = None, **sampling: Any) -> pb.ChatRequest:
    req = pb.ChatRequest(model=model, request_id=request_id, messages=[_chat_message(m) for m in messages],
                         sampling_params=sampling_params(**sampling))
    if add_generation_prompt is not None:
        req.add_generation_prompt = add_generation_prompt
    return req


def to_delta(resp: pb.GenerateResponse) -> Delta:
    finish = None
    if resp.HasField("finish"):
        f = resp.finish
        which = f.WhichOneof("matched_stop")
        finish = Finish(
            reason=f.reason,
            stop_str=f.stop_str if which == "stop_str" else None,
            stop_token_id=f.stop_token_id if which == "stop_token_id" else None,
            prompt_tokens=f.usage.prompt_tokens, completion_tokens=f.usage.completion_tokens,
            cached_tokens=f.usage.cached_tokens, message=f.message,
        )
    logprobs = tuple(
        TokenLogprob(lp.token_id, lp.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top_logprobs))
        for lp in resp.logprobs)
    return Delta(resp.index, resp.text, tuple(resp.token_ids), logprobs, finish, resp.request_id)


def collect(deltas: Iterable[Delta]) -> list[Completion]:
    """Fold a stream into one Completion per index."""
    out: dict[int, Completion] = {}
    for d in deltas:
        c = out.setdefault(d.index, Completion(index=d.index))
        _add(c, d)
    return [out[i] for i in sorted(out)]


def _add(c: Completion, d: Delta) -> None:
    c.text += d.text
    c.token_ids += d.token_ids
    c.logprobs += d.logprobs
    c.request_id = d.request_id
    if d.finish is not None:
        c.finish = d.finish


def _security(tls: ChannelTls | bool | None, token: str | BearerToken | None) -> ChannelSecurity:
    """`tls`: None/False plaintext, True TLS with the system's roots, or a ChannelTls; `token`: the
    client token (a string or a BearerToken), sent on every call."""
    if tls is True:
        tls = ChannelTls()
    return ChannelSecurity(tls or None, BearerToken(token) if isinstance(token, str) else token)


def _metadata(request_id: str | None, metadata: Sequence[tuple[str, str]] | None,
              auth: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    md = list(metadata or ()) + list(auth)
    if request_id:
        md.append((REQUEST_ID_HEADER, request_id))
    return md


class RouterClient:
    """Blocking client. Thread-safe (one channel)."""

    def __init__(self, address: str, timeout: float | None = None,
                 options: Sequence[tuple[str, Any]] = (), *, tls: ChannelTls | bool | None = None,
                 token: str | BearerToken | None = None):
        self.address = address
        self.timeout = timeout  # default per-call deadline in seconds (None: none)
        security = _security(tls, token)
        self._auth = security.metadata()  # added to every call
        self.channel = security.channel(address, options)
        self.stub = pb_grpc.RouterStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout)

    def _stream(self, method, request, timeout, request_id, metadata) -> Iterator[Delta]:
        call = method(request, timeout=timeout if timeout is not None else self.timeout,
                      metadata=_metadata(request_id, metadata, self._auth))
        try:
            for resp in call:
                yield to_delta(resp)
        finally:
            call.cancel()  # no-op when the call already finished

    def generate(self, prompt: str | Sequence[int], *, model: str = "", request_id: str | None = None,
                 add_special_tokens: bool | None = None, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] | None = None, **sampling: Any) -> Iterator[Delta]:
        req = generate_request(prompt, model=model, request_id=request_id or "",
                               add_special_tokens=add_special_tokens, **sampling)
        return self._stream(self.stub.Generate, req, timeout, request_id, metadata)

    def chat(self, messages: Iterable[Message], *, model: str = "", request_id: str | None = None,
             add_generation_prompt: bool | None = None, timeout: float | None = None,
             metadata: Sequence[tuple[str, str]] | None = None, **sampling: Any) -> Iterator[Delta]:
        req = chat_request(messages, model=model, request_id=request_id or "",
                           add_generation_prompt=add_generation_prompt, **sampling)
        return self._stream(self.stub.Chat, req, timeout, request_id, metadata)

    def complete(self, prompt: str | Sequence[int], **kwargs: Any) -> list[Completion]:
        """All sequences of a Generate call, collected (one per index)."""
        return collect(self.generate(prompt, **kwargs))

    def generate_text(self, prompt: str | Sequence[int], **kwargs: Any) -> str:
        return self.complete(prompt, **kwargs)[0].text

    def tokenize(self, text: str, add_special_tokens: bool | None = None, timeout: float | None = None) -> list[int]:
        req = pb.TokenizeRequest(text=text)
        if add_special_tokens is not None:
            req.add_special_tokens = add_special_tokens
        return list(self.stub.Tokenize(req, timeout=timeout or self.timeout, metadata=self._auth).token_ids)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        req = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(req, timeout=self.timeout, metadata=self._auth).text

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self._auth)

    def list_workers(self) -> pb.ListWorkersResponse:
        return self.stub.ListWorkers(pb.ListWorkersRequest(), timeout=self.timeout, metadata=self._auth)

    def health(self, service: str = "", timeout: float = 5.0) -> int:
        """grpc.health.v1 status (health_pb2.HealthCheckResponse.SERVING == 1)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


class AsyncRouterClient:
    """asyncio client (grpc.aio). Create and use it inside one event loop."""

    def __init__(self, address: str, timeout: float | None = None,
                 options: Sequence[tuple[str, Any]] = (), *, tls: ChannelTls | bool | None = None,
                 token: str | BearerToken | None = None):
        """`tls` and `token` as for RouterClient."""
        self.address = address
        self.timeout = timeout
        # The channel's interceptor adds the token to every call.
        self.channel = _security(tls, token).aio_channel(address, options)
        self.stub = pb_grpc.RouterStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncRouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        import asyncio

        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    async def _stream(self, method, request, timeout, request_id, metadata) -> AsyncIterator[Delta]:
        call = method(request, timeout=timeout if timeout is not None else self.timeout,
                      metadata=_metadata(request_id, metadata))
        try:
            async for resp in call:
                yield to_delta(resp)
        finally:
            call.cancel()

    def generate(self, prompt: str | Sequence[int], *, model: str = "", request_id: str | None = None,
                 add_special_tokens: bool | None = None, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] | None = None, **sampling: Any) -> AsyncIterator[Delta]:
        req = generate_request(prompt, model=model, request_id=request_id or "",
                               add_special_tokens=add_special_tokens, **sampling)
        return self._stream(self.stub.Generate, req, timeout, request_id, metadata)

    def chat(self, messages: Iterable[Message], *, model: str = "", request_id: str | None = None,
             add_generation_prompt: bool | None = None, timeout: float | None = None,
             metadata: Sequence[tuple[str, str]] | None = None, **sampling: Any) -> AsyncIterator[Delta]:
        req = chat_request(messages, model=model, request_id=request_id or "",
                           add_generation_prompt=add_generation_prompt, **sampling)
        return self._stream(self.stub.Chat, req, timeout, request_id, metadata)

    async def complete(self, prompt: str | Sequence[int], **kwargs: Any) -> list[Completion]:
        out: dict[int, Completion] = {}
        async for d in self.generate(prompt, **kwargs):
            _add(out.setdefault(d.index, Completion(index=d.index)), d)
        return [out[i] for i in sorted(out)]

    async def generate_text(self, prompt: str | Sequence[int], **kwargs: Any) -> str:
        return (await self.complete(prompt, **kwargs))[0].text

    async def tokenize(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        req = pb.TokenizeRequest(text=text)
        if add_special_tokens is not None:
            req.add_special_tokens = add_special_tokens
        return list((await self.stub.Tokenize(req, timeout=self.timeout)).token_ids)

    async def model_info(self) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)

    async def list_workers(self) -> pb.ListWorkersResponse:
        return await self.stub.ListWorkers(pb.ListWorkersRequest(), timeout=self.timeout)

    async def health(self, service: str = "", timeout: float = 5.0) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)).status
