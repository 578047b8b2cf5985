"""Conversions between the ``sglang.grpc.scheduler`` protocol (smg-grpc-proto) and the engine.

Proto3 has no "unset" for plain scalars, so a zero on the wire is not always a semantic value
(DESIGN.md section 2). The mapping, field by field (``SamplingParams`` message unless noted):

===========================  =====================================================================
``temperature``              as sent; 0 means greedy (argmax)
``top_p``                    0 -> 1.0 (off)
``top_k``                    0 or -1 -> off; < -1 is INVALID_ARGUMENT
``min_p``                    as sent (0 is off)
``repetition_penalty``       0 -> 1.0 (off)
``frequency/presence_pen.``  as sent (0 is off)
``max_new_tokens``           ``optional``: unset -> whatever room the prompt leaves in
                             min(context length, KV pool); set -> as sent (0 is INVALID_ARGUMENT)
``min_new_tokens``           as sent
``stop_token_ids``           as sent (smg turns single-token stop strings into these)
``stop``                     ignored: the gateway matches stop strings on decoded text itself
``ignore_eos``               as sent
``n``                        0 -> 1; n > max_running_requests is INVALID_ARGUMENT
``custom_params``            ``seed`` (or ``sampling_seed``): per-request seed, sample i uses seed+i
``regex``/``json_schema``/   INVALID_ARGUMENT (structured generation is not supported), as are a
``ebnf``/``structural_tag``  non-empty ``logit_bias``
GenerateRequest fields:
``return_logprob``           output logprobs of the sampled tokens
``top_logprobs_num``         alternatives per position (only with return_logprob, <= 20)
``logprob_start_len``        ignored: prompt (input) logprobs are not computed
``token_ids_logprob``,       INVALID_ARGUMENT (not supported), as are ``input_embeds``, multimodal
``return_hidden_states``     inputs and a ``lora_id``
===========================  =====================================================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from google.protobuf import json_format, struct_pb2, timestamp_pb2
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import common_pb2

from worker_svc.engine.request import RequestError, StepOutput
from worker_svc.sampling import SamplingParams

# Files a gateway needs to rebuild the tokenizer (and its chat template and generation defaults).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
TOKENIZER_CHUNK_BYTES = 512 * 1024
_ZIP_DATE = (2020, 1, 1, 0, 0, 0)  # fixed, so the bundle (and its sha256) depend on content only


# ---- requests ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateSpec:
    prompt_ids: list[int]
    params: list[SamplingParams]  # one per sample index (n of them)
    stream: bool

    @property
    def n(self) -> int:
        return len(self.params)


def _seed(custom: dict[str, Any]) -> int | None:
    for key in ("seed", "sampling_seed"):
        value = custom.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
            raise RequestError("custom_params.seed", f"custom_params.{key} must be an integer, got {value!r}")
        return int(value)
    return None


def _reject_unsupported(request: pb.GenerateRequest) -> None:
    sp = request.sampling_params
    constraint = sp.WhichOneof("constraint")
    if constraint is not None:
        raise RequestError(constraint, f"{constraint}: structured generation is not supported by this worker")
    if len(sp.logit_bias):
        raise RequestError("logit_bias", "logit_bias: not supported by this worker")
    if len(request.token_ids_logprob):
        raise RequestError("token_ids_logprob", "token_ids_logprob: not supported by this worker")
    if request.return_hidden_states:
        raise RequestError("return_hidden_states", "return_hidden_states: not supported by this worker")
    if len(request.input_embeds):
        raise RequestError("input_embeds", "input_embeds: not supported by this worker (send tokenized.input_ids)")
    if request.HasField("mm_inputs") and request.mm_inputs.ByteSize():
        raise RequestError("mm_inputs", "mm_inputs: this worker serves a text-only model")
    if request.lora_id:
        raise RequestError("lora_id", "lora_id: no LoRA adapters are loaded on this worker")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise RequestError(
            "data_parallel_rank", f"data_parallel_rank: this worker has one rank (0), got {request.data_parallel_rank}"
        )


def generate_spec(request: pb.GenerateRequest, *, max_seq_len: int, max_n: int) -> GenerateSpec:
    """Convert a GenerateRequest; raises RequestError naming the field for what cannot be served.

    ``max_seq_len`` is the most tokens (prompt + output) one request may hold: min(context length,
    KV pool). Range checks of the sampling values are left to ``Scheduler.validate``."""
    _reject_unsupported(request)
    prompt = list(request.tokenized.input_ids)
    if not prompt:
        raise RequestError("input_ids", "input_ids: tokenized.input_ids is empty (the prompt needs at least one token)")
    sp = request.sampling_params
    n = sp.n or 1
    if n > max_n:
        raise RequestError("n", f"n: at most {max_n} samples per request (max_running_requests), got {n}")
    max_new = sp.max_new_tokens if sp.HasField("max_new_tokens") else max(1, max_seq_len - len(prompt))
    custom = json_format.MessageToDict(sp.custom_params) if sp.HasField("custom_params") else {}
    seed = _seed(custom)
    return_logprob = bool(request.return_logprob)
    base = SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=sp.min_new_tokens,
        temperature=float(sp.temperature),
        top_k=sp.top_k,
        top_p=float(sp.top_p),
        min_p=float(sp.min_p),
        repetition_penalty=float(sp.repetition_penalty),
        frequency_penalty=float(sp.frequency_penalty),
        presence_penalty=float(sp.presence_penalty),
        seed=seed,
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        n=1,  # the server fans out: each engine request is one sample
        return_logprob=return_logprob,
        top_logprobs_num=request.top_logprobs_num if return_logprob else 0,
    ).normalized()
    params = [base if i == 0 or seed is None else dataclasses.replace(base, seed=seed + i) for i in range(n)]
    return GenerateSpec(prompt_ids=prompt, params=params, stream=request.stream)


def error_message(exc: RequestError) -> str:
    """A message that starts with the field's name."""
    text = str(exc)
    return text if text.startswith(exc.field) else f"{exc.field}: {text}"


# ---- responses -----------------------------------------------------------------------------------


def _logprobs(
    token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]]
) -> pb.OutputLogProbs:
    return pb.OutputLogProbs(
        token_logprobs=logprobs,
        token_ids=token_ids,
        top_logprobs=[pb.TopLogProbs(values=[lp for _, lp in row], token_ids=[t for t, _ in row]) for row in top],
    )


@dataclass
class SampleState:
    """What one sample index of a Generate call has produced so far."""

    index: int
    rid: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    last: StepOutput | None = None

    def add(self, out: StepOutput) -> None:
        self.output_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.top_logprobs += out.new_top_logprobs
        self.last = out

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished


def chunk_response(request_id: str, index: int, out: StepOutput, with_logprobs: bool) -> pb.GenerateResponse:
    chunk = pb.GenerateStreamChunk(
        token_ids=out.new_token_ids,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
        index=index,
    )
    if with_logprobs:
        chunk.output_logprobs.CopyFrom(_logprobs(out.new_token_ids, out.new_logprobs, out.new_top_logprobs))
    return pb.GenerateResponse(request_id=request_id, chunk=chunk)


def merge_chunks(responses: list[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    """One call's responses with each run of consecutive chunks of the same sample merged into one chunk
    of several tokens (what a client reading the stream would have seen in one message had the
    engine made them in one step). Completes are kept as they are, in order."""
    merged: list[pb.GenerateResponse] = []
    for response in responses:
        last = merged[-1] if merged else None
        if (last is not None and response.WhichOneof("response") == "chunk" and last.WhichOneof("response") == "chunk"
                and last.chunk.index == response.chunk.index and not response.chunk.HasField("input_logprobs")):
            into, more = last.chunk, response.chunk
            into.token_ids.extend(more.token_ids)
            into.prompt_tokens, into.completion_tokens = more.prompt_tokens, more.completion_tokens
            into.cached_tokens, into.reasoning_tokens = more.cached_tokens, more.reasoning_tokens
            into.hidden_states.extend(more.hidden_states)
            if more.HasField("output_logprobs"):
                lp, more_lp = into.output_logprobs, more.output_logprobs
                lp.token_logprobs.extend(more_lp.token_logprobs)
                lp.token_ids.extend(more_lp.token_ids)
                lp.top_logprobs.extend(more_lp.top_logprobs)
                lp.token_ids_logprobs.extend(more_lp.token_ids_logprobs)
            continue
        merged.append(response)
    return merged


def complete_response(request_id: str, state: SampleState, with_logprobs: bool) -> pb.GenerateResponse:
    last = state.last
    assert last is not None and last.finish_reason is not None
    complete = pb.GenerateComplete(
        output_ids=state.output_ids,
        finish_reason=last.finish_reason.value,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        index=state.index,
    )
    if last.matched_stop is not None:
        complete.matched_token_id = last.matched_stop
    if with_logprobs:
        complete.output_logprobs.CopyFrom(_logprobs(state.output_ids, state.logprobs, state.top_logprobs))
    return pb.GenerateResponse(request_id=request_id, complete=complete)


# ---- info and loads ------------------------------------------------------------------------------


def to_struct(values: dict[str, Any]) -> struct_pb2.Struct:
    def plain(v: Any) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return str(v)

    s = struct_pb2.Struct()
    s.update({k: plain(v) for k, v in values.items()})
    return s


def timestamp(epoch_s: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(epoch_s * 1e9))
    return ts


def iso_now() -> str:
    return datetime.now(timezone.utc).isoformat()


def tokenizer_bundle(model_dir: str | Path) -> tuple[bytes, str]:
    """Zip the model folder's tokenizer files (deterministically); returns (bytes, sha256 hex)."""
    root = Path(model_dir)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            path = root / name
            if path.is_file():
                info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = 0o644 << 16
                zf.writestr(info, path.read_bytes())
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def tokenizer_chunks(
    data: bytes, sha256: str, chunk_bytes: int = TOKENIZER_CHUNK_BYTES
) -> Iterator[common_pb2.GetTokenizerChunk]:
    """The bundle in chunks; the sha256 rides on the final chunk only (as the proto says)."""
    pieces = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    for i, piece in enumerate(pieces):
        yield common_pb2.GetTokenizerChunk(data=piece, sha256=sha256 if i == len(pieces) - 1 else "")
