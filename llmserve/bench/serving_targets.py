"""Where `llmserve bench-serving` sends requests: the public llmserve.v1.Router (Generate with a text
or token-id prompt) or one worker's SglangScheduler (Generate with token ids, stream=True: the call
the router itself makes). Per streamed message a target appends a timestamp and the number of new
tokens to the request's record, nothing more, so the client stays cheap at many concurrent streams."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from llmserve.bench import datasets as ds
from llmserve.bench.serving_stats import OK, RequestRecord

if TYPE_CHECKING:
    import grpc


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a benchmark carries besides its prompt and output length."""

    temperature: float = 0.0
    ignore_eos: bool = True
    served_model: str = ""  # the router's `model` field
    request_timeout: float | None = None  # deadline of one Generate
    rpc_timeout: float = 30.0  # GetModelInfo, FlushCache


@dataclass(frozen=True)
class ServerFacts:
    vocab_size: int
    special_ids: frozenset[int]
    model: str


class Target(Protocol):
    async def facts(self) -> ServerFacts: ...

    async def generate(self, prompt: ds.Prompt, output_len: int, rec: RequestRecord, keep_output: bool) -> None:
        """Send one request and fill `rec` (status included); never raises for an RPC failure."""
        ...

    async def flush_cache(self) -> bool: ...


def _fail(rec: RequestRecord, exc: BaseException) -> None:
    import grpc

    if isinstance(exc, grpc.aio.AioRpcError):
        rec.status, rec.error = exc.code().name, exc.details() or ""
    else:
        rec.status, rec.error = "CLIENT_ERROR", repr(exc)


class RouterTarget:
    """llmserve.v1.Router.Generate: token ids, or text when the prompt has it (prompt_format text)."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]], settings: RequestSettings):
        from llmserve.v1 import router_pb2, router_pb2_grpc

        self.pb = router_pb2
        self.stub = router_pb2_grpc.RouterStub(channel)
        self.metadata = tuple(metadata)
        self.settings = settings
        self._ids = 0

    async def facts(self) -> ServerFacts:
        info = await self.stub.GetModelInfo(self.pb.GetModelInfoRequest(model=self.settings.served_model),
                                            metadata=self.metadata, timeout=self.settings.rpc_timeout)
        special = set(info.eos_token_ids)
        if info.HasField("bos_token_id"):
            special.add(info.bos_token_id)
        return ServerFacts(info.vocab_size, frozenset(special), info.model)

    async def flush_cache(self) -> bool:
        return False

    async def generate(self, prompt: ds.Prompt, output_len: int, rec: RequestRecord, keep_output: bool) -> None:
        cfg = self.settings
        self._ids += 1
        rec.request_id = f"bench-{self._ids}"  # a label: the router logs it and hands it to the worker's logs
        req = self.pb.GenerateRequest(
            model=cfg.served_model, request_id=rec.request_id,
            sampling_params=self.pb.SamplingParams(max_new_tokens=output_len, temperature=cfg.temperature,
                                                   ignore_eos=cfg.ignore_eos))
        keep_text = keep_output and prompt.text is not None
        if prompt.text is not None:
            req.text = prompt.text
        else:
            req.token_ids.ids.extend(prompt.ids)
        now = time.perf_counter
        stamp, count = rec.stamps.append, rec.counts.append
        last = None
        try:
            rec.sent = now()
            call = self.stub.Generate(req, metadata=self.metadata, timeout=cfg.request_timeout)
            async for resp in call:
                n = len(resp.token_ids)
                if n:
                    stamp(now())
                    count(n)
                    if keep_output:
                        rec.output_ids.extend(resp.token_ids)
                if keep_text:
                    rec.output_text.append(resp.text)
                last = resp
            rec.done = now()
        except Exception as exc:  # noqa: BLE001 - any failure is this request's outcome
            rec.done = now()
            _fail(rec, exc)
            return
        if last is None or not last.HasField("finish"):
            rec.status, rec.error = "INCOMPLETE", "the stream ended without a finish message"
            return
        finish = last.finish
        rec.finish_reason = finish.reason
        rec.prompt_tokens = finish.usage.prompt_tokens
        rec.completion_tokens = finish.usage.completion_tokens
        rec.cached_tokens = finish.usage.cached_tokens
        if finish.reason == "abort":
            rec.status, rec.error = "ABORTED", finish.message
        else:
            rec.status = OK


class WorkerTarget:
    """A worker's SglangScheduler.Generate (stream=True): token ids in, chunks of ids out."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]], settings: RequestSettings):
        from smg_grpc_proto import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc
        from smg_grpc_proto.generated import common_pb2

        self.pb = sglang_scheduler_pb2
        self.common = common_pb2
        self.stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        self.metadata = tuple(metadata)
        self.settings = settings
        self._ids = 0

    async def facts(self) -> ServerFacts:
        info = await self.stub.GetModelInfo(self.pb.GetModelInfoRequest(), metadata=self.metadata,
                                            timeout=self.settings.rpc_timeout)
        special = set(info.eos_token_ids)
        if info.bos_token_id:
            special.add(info.bos_token_id)
        return ServerFacts(info.vocab_size, frozenset(special), info.served_model_name)

    async def flush_cache(self) -> bool:
        resp = await self.stub.FlushCache(self.common.FlushCacheRequest(), metadata=self.metadata,
                                          timeout=self.settings.rpc_timeout)
        return bool(resp.success)

    async def generate(self, prompt: ds.Prompt, output_len: int, rec: RequestRecord, keep_output: bool) -> None:
        cfg = self.settings
        self._ids += 1
        rec.request_id = f"bench-{self._ids}"
        req = self.pb.GenerateRequest(
            request_id=rec.request_id, tokenized=self.pb.TokenizedInput(input_ids=prompt.ids),
            sampling_params=self.pb.SamplingParams(max_new_tokens=output_len, temperature=cfg.temperature,
                                                   ignore_eos=cfg.ignore_eos),
            stream=True)
        now = time.perf_counter
        stamp, count = rec.stamps.append, rec.counts.append
        last = None
        try:
            rec.sent = now()
            call = self.stub.Generate(req, metadata=self.metadata, timeout=cfg.request_timeout)
            async for resp in call:
                n = len(resp.chunk.token_ids)  # 0 on the Complete message
                if n:
                    stamp(now())
                    count(n)
                last = resp
            rec.done = now()
        except Exception as exc:  # noqa: BLE001 - any failure is this request's outcome
            rec.done = now()
            _fail(rec, exc)
            return
        if last is None or not last.HasField("complete"):
            rec.status, rec.error = "INCOMPLETE", "the stream ended without a complete message"
            return
        c = last.complete
        rec.finish_reason = c.finish_reason
        rec.prompt_tokens, rec.completion_tokens = c.prompt_tokens, c.completion_tokens
        rec.cached_tokens = c.cached_tokens
        if keep_output:
            rec.output_ids.extend(c.output_ids)
        rec.status = "ABORTED" if c.finish_reason == "abort" else OK
