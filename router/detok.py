"""One request's incremental detokenization: in the router's own process, or on the tokenizer service.

`LocalDetokenizer` (the default, `--detokenize router`): the tokenizer service's tokenizer, fetched
once (GetTokenizerJson) into a `LocalVocabulary`, runs the same IncrementalDetokenizer the service
runs, so a generated token costs no round trip to another process. Served through the router, those
round trips were most of the router's cost per token: two more gRPC messages per token, each
answered by a process that waits for a core the worker's forward keeps busy.

`StreamDetokenizer` (`--detokenize service`, and the fallback when the tokenizer service predates
GetTokenizerJson): the tokenizer service's DetokenizeStream. One call per router request (the
tokenizer proto recommends it: an error fails the whole call), opened on the first token; each of
the request's n sequences is a sequence_id on it. Messages are
strictly request/response on the call, and one router request feeds it from a single coroutine, so
no locking is needed. Each step (write, then read) runs shielded (router/background.py), and a
request that ends early half-closes the call instead of cancelling it: cancelling a grpc.aio call
with a batch in flight leaks native memory (grpc/grpc#43360).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Protocol

import grpc
from tokenizers import Tokenizer

from llmserve.grpc_server import REQUEST_ID_HEADER
from llmserve.incremental_detok import IncrementalDetokenizer
from llmserve.token_ids import first_out_of_range
from llmserve.v1 import tokenizer_pb2 as tpb
from llmserve.v1 import tokenizer_pb2_grpc as tpb_grpc
from router.background import BackgroundCalls


class DetokenizeError(Exception):
    pass


class Detokenizer(Protocol):
    """One router request's detokenization; each of its n sequences is a `sequence_id`."""

    async def push(self, sequence_id: int, token_ids: list[int], final: bool = False) -> str:
        """Text that became final with these ids (all remaining text when final)."""
        ...

    async def close(self) -> None:
        """The request ended normally."""
        ...

    def abandon(self) -> None:
        """The request ended early (cancelled or failed). Synchronous, safe in `finally`."""
        ...


class LocalVocabulary:
    """The tokenizer service's tokenizer, in this process: decode and the id range check, as the
    service does them."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, sha256: str = ""):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.sha256 = sha256

    @classmethod
    def from_response(cls, resp: tpb.GetTokenizerJsonResponse) -> LocalVocabulary:
        return cls(Tokenizer.from_str(resp.tokenizer_json), resp.vocab_size, resp.sha256)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def out_of_range(self, ids: Sequence[int]) -> str | None:
        """What is wrong with `ids` (the first id outside [0, vocab_size)), or None."""
        found = first_out_of_range(ids, self.vocab_size)
        if found is None:
            return None
        pos, bad = found
        return f"id {bad} at position {pos} is out of range [0, {self.vocab_size})"


class LocalDetokenizer:
    """Detokenizer in the router's process: one IncrementalDetokenizer per open sequence."""

    def __init__(self, vocab: LocalVocabulary, skip_special_tokens: bool):
        self._vocab = vocab
        self._skip = skip_special_tokens
        self._open: dict[int, IncrementalDetokenizer] = {}

    async def push(self, sequence_id: int, token_ids: list[int], final: bool = False) -> str:
        problem = self._vocab.out_of_range(token_ids)
        if problem is not None:
            raise DetokenizeError(f"token_ids (sequence_id {sequence_id}): {problem}")
        det = self._open.get(sequence_id)
        if det is None:
            if not token_ids:
                return ""  # never opened: nothing to flush
            det = self._open[sequence_id] = IncrementalDetokenizer(self._vocab.decode, self._skip)
        text = det.push(token_ids)
        if final:
            text += det.flush()
            del self._open[sequence_id]
        return text

    async def close(self) -> None:
        self._open.clear()

    def abandon(self) -> None:
        self._open.clear()


class StreamDetokenizer:
    def __init__(self, stub: tpb_grpc.TokenizerStub, background: BackgroundCalls, request_id: str,
                 skip_special_tokens: bool, timeout: float | None = None, close_timeout: float = 30.0):
        self._stub = stub
        self._background = background
        self._close_timeout = close_timeout  # for a call abandoned mid-request to end on its own
        self._step: asyncio.Future[tpb.DetokenizeStreamResponse | object] | None = None
        self._metadata = ((REQUEST_ID_HEADER, request_id),)
        self._skip = skip_special_tokens
        self._timeout = timeout
        self._call: grpc.aio.StreamStreamCall[tpb.DetokenizeStreamRequest, tpb.DetokenizeStreamResponse] | None = None
        self._open: set[int] = set()

    async def push(self, sequence_id: int, token_ids: list[int], final: bool = False) -> str:
        """Text that became final with these ids (all remaining text when final)."""
        if not token_ids and not final:
            return ""
        if final and sequence_id not in self._open and not token_ids:
            return ""  # never opened: nothing to flush
        if self._call is None:
            self._call = self._stub.DetokenizeStream(metadata=self._metadata, timeout=self._timeout)
        request = tpb.DetokenizeStreamRequest(
            sequence_id=sequence_id, token_ids=token_ids, final=final, skip_special_tokens=self._skip)
        self._step = self._background.spawn(self._exchange(self._call, request))
        try:
            resp = await asyncio.shield(self._step)
        except grpc.aio.AioRpcError as exc:
            raise DetokenizeError(f"tokenizer service: {exc.code().name}: {exc.details()}") from exc
        except grpc.aio.UsageError as exc:  # the call already ended
            raise DetokenizeError(f"tokenizer service: stream closed ({exc})") from exc
        if not isinstance(resp, tpb.DetokenizeStreamResponse):  # grpc.aio.EOF
            code = await self._call.code()
            raise DetokenizeError(f"tokenizer service ended the stream ({code.name})")
        if final:
            self._open.discard(sequence_id)
        else:
            self._open.add(sequence_id)
        return resp.text

    @staticmethod
    async def _exchange(call: grpc.aio.StreamStreamCall[tpb.DetokenizeStreamRequest, tpb.DetokenizeStreamResponse],
                        request: tpb.DetokenizeStreamRequest) -> tpb.DetokenizeStreamResponse | object:
        await call.write(request)
        return await call.read()

    async def close(self) -> None:
        """Half-close after a normal end (the server then finishes the call)."""
        if self._call is not None and not self._call.done():
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await self._call.done_writing()

    def abandon(self) -> None:
        """The request ended early (cancelled or failed): let the call end in the background, after
        its step in flight, by half-closing it; cancelled only if it outlives `close_timeout`.
        Synchronous, safe in `finally`."""
        if self._call is not None and not self._call.done():
            self._background.spawn(self._finish(self._call, self._step))

    async def _finish(self, call: grpc.aio.StreamStreamCall[tpb.DetokenizeStreamRequest, tpb.DetokenizeStreamResponse],
                      step: asyncio.Future[object] | None) -> None:
        async def drain() -> None:
            if step is not None:
                await asyncio.wait([step])
            if not call.done():
                with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                    await call.done_writing()
                    while await call.read() is not grpc.aio.EOF:
                        pass
        try:
            await asyncio.wait_for(drain(), self._close_timeout)
        except TimeoutError:
            call.cancel()
