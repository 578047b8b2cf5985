"""gRPC server for llmserve.v1.Tokenizer (grpc.aio), with grpc.health.v1 and server reflection.

Stateless apart from the open DetokenizeStream calls, each of which keeps one
IncrementalDetokenizer per live sequence_id. Bad input is INVALID_ARGUMENT with the field named;
Encode of a chat on a model without a chat template is FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from llmserve.grpc_server import (
    REQUEST_ID_HEADER,
    ServiceHealth,
    grpc_address,
    listen,
    metadata_value,
    stop_signal_event,
    write_port_file,
)
from llmserve.incremental_detok import IncrementalDetokenizer
from llmserve.logging import get_logger, request_context
from llmserve.message_limits import message_size_options
from llmserve.metrics import TokenizerMetrics
from llmserve.security import HEALTH_METHODS, ServerSecurity
from llmserve.v1 import tokenizer_pb2 as pb
from llmserve.v1 import tokenizer_pb2_grpc as pb_grpc
from tokenizer_svc.tokenizer import ChatMessage, ModelTokenizer, NoChatTemplateError, TokenizerInputError

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tokenizer"].full_name
# Texts longer than this are encoded on a worker thread so one huge prompt does not stall the
# event loop (health checks, other calls); short ones are cheaper inline.
_INLINE_ENCODE_CHARS = 16_384
# Bound the per-call state a client can pin: one detokenizer per live sequence.
MAX_STREAM_SEQUENCES = 4096

log = get_logger(__name__)


def _request_id(context: grpc.aio.ServicerContext) -> str:
    return metadata_value(context, REQUEST_ID_HEADER)


async def _abort_invalid(context: grpc.aio.ServicerContext, error: TokenizerInputError) -> NoReturn:
    code = (grpc.StatusCode.FAILED_PRECONDITION if isinstance(error, NoChatTemplateError)
            else grpc.StatusCode.INVALID_ARGUMENT)
    log.info("rejected", rpc_error=str(error), code=code.name)
    await context.abort(code, str(error))


class TokenizerServicer(pb_grpc.TokenizerServicer):
    def __init__(self, tokenizer: ModelTokenizer):
        self.tok = tokenizer
        self._tokenizer_json: pb.GetTokenizerJsonResponse | None = None

    def _encode(self, request: pb.EncodeRequest) -> pb.EncodeResponse:
        which = request.WhichOneof("input")
        if which == "text":
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            return pb.EncodeResponse(token_ids=self.tok.encode(request.text, add_special),
                                     prompt_text=request.text)
        if which == "chat":
            messages = []
            for i, m in enumerate(request.chat.messages):
                if not m.role:
                    raise TokenizerInputError(f"chat.messages[{i}].role", "must not be empty")
                messages.append(ChatMessage(m.role, m.content))
            ids, text = self.tok.encode_chat(messages, request.chat.add_generation_prompt)
            return pb.EncodeResponse(token_ids=ids, prompt_text=text)
        raise TokenizerInputError("input", "set exactly one of `text` or `chat`")

    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        with request_context(_request_id(context), rpc="Encode"):
            try:
                size = len(request.text) + sum(len(m.content) for m in request.chat.messages)
                if size > _INLINE_ENCODE_CHARS:
                    response = await asyncio.to_thread(self._encode, request)
                else:
                    response = self._encode(request)
            except TokenizerInputError as e:
                await _abort_invalid(context, e)
            log.debug("encoded", input=request.WhichOneof("input"), num_tokens=len(response.token_ids))
            return response

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> pb.DecodeResponse:
        with request_context(_request_id(context), rpc="Decode"):
            try:
                self.tok.check_ids(request.token_ids, "token_ids")
            except TokenizerInputError as e:
                await _abort_invalid(context, e)
            return pb.DecodeResponse(text=self.tok.decode(request.token_ids, request.skip_special_tokens))

    async def DetokenizeStream(
        self, request_iterator: AsyncIterator[pb.DetokenizeStreamRequest], context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.DetokenizeStreamResponse]:
        with request_context(_request_id(context), rpc="DetokenizeStream"):
            live: dict[int, IncrementalDetokenizer] = {}
            async for req in request_iterator:
                sid = req.sequence_id
                try:
                    self.tok.check_ids(req.token_ids, f"token_ids (sequence_id {sid})")
                    det = live.get(sid)
                    if det is None:
                        self.tok.check_ids(req.context_token_ids, f"context_token_ids (sequence_id {sid})")
                        if len(live) >= MAX_STREAM_SEQUENCES:
                            raise TokenizerInputError(
                                "sequence_id", f"more than {MAX_STREAM_SEQUENCES} open sequences on one call; "
                                "close some with final = true")
                        det = live[sid] = IncrementalDetokenizer(
                            self.tok.decode, req.skip_special_tokens, req.context_token_ids)
                except TokenizerInputError as e:
                    await _abort_invalid(context, e)
                text = det.push(req.token_ids)
                if req.final:
                    text += det.flush()
                    del live[sid]
                yield pb.DetokenizeStreamResponse(sequence_id=sid, text=text, final=req.final,
                                                  num_tokens=det.num_tokens)
            if live:
                log.debug("stream closed with open sequences", open=len(live))

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:
        tok = self.tok
        return pb.GetInfoResponse(
            vocab_size=tok.vocab_size,
            bos_token_id=tok.bos_token_id,
            eos_token_ids=tok.eos_token_ids,
            bos_token=tok.bos_token or "",
            eos_token=tok.eos_token or "",
            special_tokens=[pb.SpecialToken(id=i, content=c) for i, c in tok.special_tokens.items()],
            has_chat_template=tok.has_chat_template,
            chat_template=tok.chat_template_source or "",
            model_max_length=tok.model_max_length,
        )

    async def GetTokenizerJson(self, request: pb.GetTokenizerJsonRequest,
                               context: grpc.aio.ServicerContext) -> pb.GetTokenizerJsonResponse:
        if self._tokenizer_json is None:  # serialized once, off the event loop (~100 ms for 128k ids)
            text = await asyncio.to_thread(self.tok.tokenizer.to_str)
            self._tokenizer_json = pb.GetTokenizerJsonResponse(
                tokenizer_json=text, sha256=hashlib.sha256(text.encode()).hexdigest(), vocab_size=self.tok.vocab_size)
        return self._tokenizer_json


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: ServiceHealth
    metrics: TokenizerMetrics | None = None

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.metrics is not None:
            self.metrics.stop_serving()


async def start_server(model: str | Path | ModelTokenizer, host: str = "127.0.0.1", port: int = 0,
                       security: ServerSecurity = ServerSecurity(),
                       metrics: TokenizerMetrics | None = None) -> RunningServer:
    """Start serving on host:port (port 0 picks a free one); return the server and its bound port.
    `security`: TLS, and the internal token every call but grpc.health.v1 must carry. `metrics`: the
    service's metric set (llmserve/metrics.py), served until `stop`; None: no metrics."""
    tokenizer = model if isinstance(model, ModelTokenizer) else ModelTokenizer.from_dir(model)
    counting = [metrics.grpc.interceptor()] if metrics is not None else []
    server = grpc.aio.server(options=message_size_options(),  # the router's bound, not grpc's 4 MiB
                             interceptors=[*counting,
                                           *security.interceptors(HEALTH_METHODS, realm="tokenizer service")])
    pb_grpc.add_TokenizerServicer_to_server(TokenizerServicer(tokenizer), server)
    health_servicer = ServiceHealth(SERVICE_NAME)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    bound = listen(server, host, port, security.tls)
    if metrics is not None:
        metrics.serve()
    await server.start()
    await health_servicer.set_serving(True)
    return RunningServer(server, bound, health_servicer, metrics)


async def _serve(model_dir: str | Path, host: str, port: int, port_file: str | Path | None,
                 security: ServerSecurity, metrics: TokenizerMetrics | None) -> int:
    running = await start_server(model_dir, host, port, security, metrics)
    log.info("tokenizer service listening", address=grpc_address(host, running.port), model=str(model_dir),
             tls=security.tls is not None, mtls=security.tls is not None and security.tls.mutual,
             auth=security.tokens is not None)
    if port_file is not None:
        write_port_file(port_file, running.port)
    await stop_signal_event().wait()
    log.info("tokenizer service stopping")
    await running.stop()
    return 0


def serve(model_dir: str | Path, host: str = "127.0.0.1", port: int = 0,
          port_file: str | Path | None = None, security: ServerSecurity = ServerSecurity(),
          metrics: TokenizerMetrics | None = None) -> int:
    """Serve until SIGINT or SIGTERM, then stop gracefully and return 0."""
    return asyncio.run(_serve(model_dir, host, port, port_file, security, metrics))
