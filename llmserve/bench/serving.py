"""The serving benchmark behind `llmserve bench-serving` (sglang's bench_serving over gRPC).

One grpc.aio channel, one asyncio task per request; requests leave on a Poisson schedule (or all at
once) and, with a concurrency cap, wait for a free slot first (the latency clock starts when the
request is sent, as sglang's). Per streamed message the client only appends a timestamp and the
number of new tokens, so it stays cheap at many concurrent streams; everything else is computed
once the run is over.

Targets: the public llmserve.v1.Router (Generate, a text or token-id prompt) or one worker's
SglangScheduler (Generate with token ids, stream=True), the path the router itself takes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from llmserve.bench import datasets as ds

if TYPE_CHECKING:  # grpc and the protos load when a run starts, not when the CLI parses flags
    import grpc

    from llmserve.security import ChannelSecurity

BACKENDS = ("router", "worker")
DATASETS = ("random", "shared-prefix", "multi-turn")
PROMPT_FORMATS = ("ids", "text")
OK = "OK"
NOT_SENT = "NOT_SENT"  # a multi-turn turn after a failed one
# Large enough for long token-id prompts and complete messages with every output id.
_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20))


# ---- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 100  # random, shared-prefix
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    num_prefixes: int = 4  # shared-prefix
    prefix_len: int = 512
    suffix_len: int = 64
    num_conversations: int = 8  # multi-turn
    turns: int = 4
    turn_len: int = 64
    output_len: int = 32  # shared-prefix and multi-turn

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"--dataset: one of {', '.join(DATASETS)}, got {self.name!r}")
        positive = {"--num-prompts": self.num_prompts, "--random-input-len": self.random_input_len,
                    "--random-output-len": self.random_output_len, "--num-prefixes": self.num_prefixes,
                    "--prefix-len": self.prefix_len, "--suffix-len": self.suffix_len,
                    "--num-conversations": self.num_conversations, "--turns": self.turns,
                    "--turn-len": self.turn_len, "--output-len": self.output_len}
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag}: must be >= 1, got {value}")
        if not 0.0 <= self.random_range_ratio <= 1.0:
            raise ValueError(f"--random-range-ratio: must be in [0, 1], got {self.random_range_ratio}")

    @property
    def num_requests(self) -> int:
        return self.num_conversations * self.turns if self.name == "multi-turn" else self.num_prompts

    def describe(self) -> dict[str, Any]:
        """The fields that shape this dataset (for the results file)."""
        keys = {"random": ("num_prompts", "random_input_len", "random_output_len", "random_range_ratio"),
                "shared-prefix": ("num_prompts", "num_prefixes", "prefix_len", "suffix_len", "output_len"),
                "multi-turn": ("num_conversations", "turns", "turn_len", "output_len")}[self.name]
        return {"name": self.name, **{k: getattr(self, k) for k in keys}}


@dataclass(frozen=True)
class BenchConfig:
    backend: str
    address: str
    dataset: DatasetConfig
    model_dir: str | None = None  # the model folder: its tokenizer (text prompts, special ids)
    request_rates: tuple[float, ...] = (float("inf"),)
    max_concurrencies: tuple[int | None, ...] = (None,)
    seed: int = 1
    prompt_format: str = "ids"
    ignore_eos: bool = True
    temperature: float = 0.0
    served_model: str = ""  # the router's `model` field
    warmup_requests: int = 1
    request_timeout: float | None = None
    flush_cache: bool = False  # worker backend: FlushCache before each run
    security: ChannelSecurity | None = None
    output_file: Path | None = None
    output_details: bool = False
    wait_for_server: float = 0.0  # retry GetModelInfo this long while the server is unavailable
    rpc_timeout: float = 30.0  # GetModelInfo, FlushCache

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend: one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"--prompt-format: one of {', '.join(PROMPT_FORMATS)}, got {self.prompt_format!r}")
        if self.prompt_format == "text" and not self.model_dir:
            raise ValueError("--prompt-format text: needs --model DIR (the tokenizer that makes and counts the text)")
        if self.flush_cache and self.backend != "worker":
            raise ValueError("--flush-cache: only with --backend worker (the router has no FlushCache)")
        for rate in self.request_rates:
            if not rate > 0:
                raise ValueError(f"--request-rate: must be > 0 (inf: all at once), got {rate}")
        for c in self.max_concurrencies:
            if c is not None and c < 1:
                raise ValueError(f"--max-concurrency: must be >= 1, got {c}")
        if self.warmup_requests < 0:
            raise ValueError(f"--warmup-requests: must be >= 0, got {self.warmup_requests}")
        if self.wait_for_server < 0:
            raise ValueError(f"--wait-for-server: must be >= 0, got {self.wait_for_server}")
        if self.temperature < 0:
            raise ValueError(f"--temperature: must be >= 0, got {self.temperature}")


# ---- per-request records -------------------------------------------------------------------------


@dataclass(slots=True)
class RequestRecord:
    """What one request did. `stamps[j]` is when the j-th message with tokens arrived, carrying
    `counts[j]` of them (perf_counter seconds, like `sent` and `done`)."""

    index: int
    expected_output_len: int
    input_len: int  # the prompt's ids as the client knows them; the server's count wins when reported
    conversation: int = -1
    turn: int = -1
    group: int = -1
    sent: float = 0.0
    done: float = 0.0
    stamps: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    status: str = NOT_SENT
    error: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)  # multi-turn only: the answer, for the next turn
    output_text: list[str] = field(default_factory=list)  # multi-turn with text prompts only

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens or sum(self.counts)

    @property
    def prompt_len(self) -> int:
        return self.prompt_tokens or self.input_len

    @property
    def ttft(self) -> float | None:
        return self.stamps[0] - self.sent if self.stamps else None

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        ttft, out = self.ttft, self.output_tokens
        return (self.e2e - ttft) / (out - 1) if ttft is not None and out > 1 else None

    def itls(self) -> list[float]:
        """Gaps between messages; a message with k tokens counts as k gaps of a k-th of its wait."""
        out: list[float] = []
        for j in range(1, len(self.stamps)):
            gap, k = self.stamps[j] - self.stamps[j - 1], self.counts[j]
            out.extend([gap / k] * k)
        return out

    def detail(self) -> dict[str, Any]:
        ttft, tpot = self.ttft, self.tpot
        return {
            "index": self.index, "conversation": self.conversation, "turn": self.turn, "group": self.group,
            "status": self.status, "error": self.error, "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_len, "output_tokens": self.output_tokens,
            "expected_output_len": self.expected_output_len, "cached_tokens": self.cached_tokens,
            "ttft_ms": None if ttft is None else 1e3 * ttft, "tpot_ms": None if tpot is None else 1e3 * tpot,
            "e2e_ms": 1e3 * self.e2e if self.status != NOT_SENT else None,
            "itl_ms": [1e3 * x for x in self.itls()],
        }


# ---- targets -------------------------------------------------------------------------------------


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

    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]], config: BenchConfig):
        from llmserve.v1 import router_pb2, router_pb2_grpc

        self.pb = router_pb2
        self.stub = router_pb2_grpc.RouterStub(channel)
        self.metadata = tuple(metadata)
        self.config = config

    async def facts(self) -> ServerFacts:
        info = await self.stub.GetModelInfo(self.pb.GetModelInfoRequest(model=self.config.served_model),
                                            metadata=self.metadata, timeout=self.config.rpc_timeout)
        special = set(info.eos_token_ids)
        if info.HasField("bos_token_id"):
            special.add(info.bos_token_id)
        return ServerFacts(info.vocab_size, frozenset(special), info.model)

    async def flush_cache(self) -> bool:
        return False

    async def generate(self, prompt: ds.Prompt, output_len: int, rec: RequestRecord, keep_output: bool) -> None:
        cfg = self.config
        req = self.pb.GenerateRequest(model=cfg.served_model, sampling_params=self.pb.SamplingParams(
            max_new_tokens=output_len, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos))
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

    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]], config: BenchConfig):
        from smg_grpc_proto import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc
        from smg_grpc_proto.generated import common_pb2

        self.pb = sglang_scheduler_pb2
        self.common = common_pb2
        self.stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        self.metadata = tuple(metadata)
        self.config = config
        self._ids = 0

    async def facts(self) -> ServerFacts:
        info = await self.stub.GetModelInfo(self.pb.GetModelInfoRequest(), metadata=self.metadata,
                                            timeout=self.config.rpc_timeout)
        special = set(info.eos_token_ids)
        if info.bos_token_id:
            special.add(info.bos_token_id)
        return ServerFacts(info.vocab_size, frozenset(special), info.served_model_name)

    async def flush_cache(self) -> bool:
        resp = await self.stub.FlushCache(self.common.FlushCacheRequest(), metadata=self.metadata,
                                          timeout=self.config.rpc_timeout)
        return bool(resp.success)

    async def generate(self, prompt: ds.Prompt, output_len: int, rec: RequestRecord, keep_output: bool) -> None:
        cfg = self.config
        self._ids += 1
        req = self.pb.GenerateRequest(
            request_id=f"bench-{self._ids}", tokenized=self.pb.TokenizedInput(input_ids=prompt.ids),
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


# ---- one run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A run's prompts: single requests, or conversations (multi-turn)."""

    requests: tuple[ds.BenchRequest, ...] = ()
    conversations: tuple[ds.Conversation, ...] = ()


def build_workload(cfg: DatasetConfig, space: ds.TokenSpace, seed: int,
                   codec: ds.TextCodec | None = None) -> Workload:
    """The dataset of one run; with `codec` (the tokenizer) as text prompts, drawn from the ids
    whose text is whole characters."""
    maker = None
    if codec is not None:
        space = ds.text_space(space, codec)
        maker = ds.TextMaker(codec, space, random.Random(seed ^ 0x7E47))
    if cfg.name == "multi-turn":
        convs = ds.conversations(cfg.num_conversations, cfg.turns, cfg.turn_len, cfg.output_len, space, seed)
        if maker is not None:  # each user message as text; a turn's ids come from its whole text
            convs = [dataclasses.replace(c, user_turns=tuple(ds.Prompt(u.ids, maker.text(u.ids))
                                                             for u in c.user_turns)) for c in convs]
        return Workload(conversations=tuple(convs))
    if cfg.name == "shared-prefix":
        reqs = ds.shared_prefix_requests(cfg.num_prompts, cfg.num_prefixes, cfg.prefix_len, cfg.suffix_len,
                                         cfg.output_len, space, seed)
    else:
        reqs = ds.random_requests(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                                  cfg.random_range_ratio, space, seed)
    if maker is not None:
        reqs = ds.requests_as_text(reqs, maker)
    return Workload(requests=tuple(reqs))


@dataclass
class RunResult:
    request_rate: float
    max_concurrency: int | None
    seed: int
    records: list[RequestRecord]
    duration: float
    client_cpu_s: float


async def _execute(target: Target, workload: Workload, rate: float, concurrency: int | None, seed: int,
                   codec: ds.TextCodec | None) -> RunResult:
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    records: list[RequestRecord] = []

    async def send(prompt: ds.Prompt, output_len: int, rec: RequestRecord, keep: bool) -> None:
        if slots is None:
            await target.generate(prompt, output_len, rec, keep)
            return
        async with slots:
            await target.generate(prompt, output_len, rec, keep)

    async def converse(conv: ds.Conversation, recs: list[RequestRecord]) -> None:
        prompt: ds.Prompt | None = None
        for k, user in enumerate(conv.user_turns):
            prompt = _next_turn(prompt, recs[k - 1] if k else None, user, codec)
            recs[k].input_len = len(prompt.ids)
            keep = k + 1 < len(conv.user_turns)
            await send(prompt, conv.output_len, recs[k], keep)
            if not recs[k].ok:
                return  # the rest of the chat stays NOT_SENT

    jobs: list[Callable[[], Awaitable[None]]]
    if workload.conversations:
        chats = [
            [RequestRecord(index=c.index * len(c.user_turns) + k, expected_output_len=c.output_len, input_len=0,
                           conversation=c.index, turn=k) for k in range(len(c.user_turns))]
            for c in workload.conversations]
        records = [r for recs in chats for r in recs]
        jobs = [functools.partial(converse, c, recs) for c, recs in zip(workload.conversations, chats, strict=True)]
    else:
        records = [RequestRecord(index=i, expected_output_len=r.output_len, input_len=len(r.prompt.ids),
                                 group=r.group) for i, r in enumerate(workload.requests)]
        jobs = [functools.partial(send, r.prompt, r.output_len, rec, False)
                for r, rec in zip(workload.requests, records, strict=True)]

    # Multi-turn: the schedule starts conversations; a later turn goes when the previous answer is in.
    offsets = ds.arrival_offsets(len(jobs), rate, seed)
    tasks = []
    cpu0 = time.process_time()
    start = time.perf_counter()
    for job, offset in zip(jobs, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(job()))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return RunResult(rate, concurrency, seed, records, duration, time.process_time() - cpu0)


def _next_turn(prev: ds.Prompt | None, answer: RequestRecord | None, user: ds.Prompt,
               codec: ds.TextCodec | None) -> ds.Prompt:
    """Turn k's prompt: turn k-1's prompt, its answer, then the new user message."""
    if codec is None or user.text is None:
        ids = user.ids if prev is None or answer is None else prev.ids + tuple(answer.output_ids) + user.ids
        return ds.Prompt(ids)
    if prev is None or answer is None:
        text = user.text
    else:
        said = "".join(answer.output_text) if answer.output_text else codec.decode(answer.output_ids,
                                                                                  skip_special_tokens=True)
        text = (prev.text or "") + said + user.text
    return ds.Prompt(tuple(codec.encode(text, add_special_tokens=True)), text)


# ---- statistics ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    rank = (len(s) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def distribution(values: Sequence[float], scale: float = 1e3) -> dict[str, float]:
    """mean, median, p90, p99, std (population) and max of `values` times `scale` (ms by default)."""
    if not values:
        return {k: math.nan for k in ("mean", "median", "p90", "p99", "std", "max")}
    v = [x * scale for x in values]
    mean = sum(v) / len(v)
    return {"mean": mean, "median": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99),
            "std": math.sqrt(sum((x - mean) ** 2 for x in v) / len(v)), "max": max(v)}


def summarize(result: RunResult) -> dict[str, Any]:
    """The aggregate metrics of a run, with sglang's names where it has one."""
    ok = [r for r in result.records if r.ok]
    duration = result.duration
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    failures: dict[str, int] = {}
    for r in result.records:
        if not r.ok:
            failures[r.status] = failures.get(r.status, 0) + 1
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [x for r in ok for x in r.itls()]
    e2es = [r.e2e for r in ok]
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(result.records) - len(ok),
        "failures": failures,
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": cached,
        "cache_hit_rate": cached / total_in if total_in else 0.0,
        "mean_request_cache_hit_ratio": (sum(r.cached_tokens / r.prompt_len for r in ok if r.prompt_len) / len(ok)
                                         if ok else 0.0),
        "output_len_mismatches": sum(1 for r in ok if r.output_tokens != r.expected_output_len),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_throughput": total_in / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        # Requests in flight on average (sglang's "Concurrency").
        "concurrency": sum(e2es) / duration if duration > 0 else 0.0,
        "client_cpu_utilization": result.client_cpu_s / duration if duration > 0 else 0.0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2e_latency", e2es)):
        for stat, value in distribution(values).items():
            out[f"{stat}_{name}_ms"] = value
    return out


# ---- output --------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def report(config: BenchConfig, result: RunResult, metrics: dict[str, Any]) -> str:
    """sglang's result block: 40-column labels, then the value."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40} {_fmt(value):<10}")

    def section(title: str) -> None:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))

    row("Backend:", config.backend)
    row("Dataset:", config.dataset.name)
    row("Traffic request rate:", "inf" if math.isinf(result.request_rate) else result.request_rate)
    row("Max request concurrency:", result.max_concurrency if result.max_concurrency else "not set")
    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    for status, n in sorted(metrics["failures"].items()):
        row(f"  {status}:", n)
    row("Benchmark duration (s):", metrics["duration"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Total cached tokens:", metrics["total_cached_tokens"])
    row("Prefix cache hit rate (%):", 100 * metrics["cache_hit_rate"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    row("Input token throughput (tok/s):", metrics["input_throughput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_throughput"])
    row("Concurrency:", metrics["concurrency"])
    row("Client CPU (% of one core):", 100 * metrics["client_cpu_utilization"])
    if metrics["output_len_mismatches"]:
        row("Outputs not of the requested length:", metrics["output_len_mismatches"])
    for title, key, label in (("End-to-End Latency", "e2e_latency", "E2E Latency"),
                              ("Time to First Token", "ttft", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                              ("Inter-Token Latency", "itl", "ITL")):
        section(title)
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{name} {label} (ms):", metrics[f"{stat}_{key}_ms"])
        if key == "itl":
            row(f"Max {label} (ms):", metrics["max_itl_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def _json_float(value: Any) -> Any:
    """JSON has no inf or nan: inf as the string "inf", nan as null."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf"
    return value


def result_line(config: BenchConfig, result: RunResult, metrics: dict[str, Any], model: str) -> dict[str, Any]:
    """One JSONL record: the run's configuration and every aggregate metric (per request with
    --output-details)."""
    line: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(),
        "backend": config.backend, "address": config.address, "model": model,
        "dataset": config.dataset.describe(), "prompt_format": config.prompt_format,
        "request_rate": result.request_rate, "max_concurrency": result.max_concurrency, "seed": result.seed,
        "num_requests": len(result.records), "ignore_eos": config.ignore_eos, "temperature": config.temperature,
        **metrics,
    }
    if config.output_details:
        line["requests"] = [r.detail() for r in result.records]
    return {k: _json_float(v) for k, v in line.items()}


# ---- the benchmark -------------------------------------------------------------------------------


class BenchError(Exception):
    """The benchmark cannot run (the server is unreachable, the warm-up failed): exit 1 with this."""


@dataclass
class BenchOutcome:
    runs: list[tuple[RunResult, dict[str, Any]]]
    model: str

    @property
    def all_ok(self) -> bool:
        return all(m["failed"] == 0 for _, m in self.runs)


def token_space(facts: ServerFacts, codec: Any | None) -> ds.TokenSpace:
    """The server's vocabulary (the tokenizer's, when smaller) without special tokens."""
    vocab, special = facts.vocab_size, set(facts.special_ids)
    if codec is not None:
        vocab = min(vocab, codec.vocab_size)
        special |= set(codec.special_tokens)
    return ds.TokenSpace(vocab, frozenset(special))


async def run_benchmark(config: BenchConfig, codec: Any | None = None, emit: Any = print) -> BenchOutcome:
    """Every run of the config (request rates x concurrencies), one after another, on one channel.
    `codec` is the model's tokenizer (tokenizer_svc ModelTokenizer): needed for text prompts,
    else it only refines the ids drawn. `emit` gets progress lines and each run's report."""
    from llmserve.security import ChannelSecurity

    security = config.security or ChannelSecurity()
    # Metadata per call rather than a token interceptor: interceptors wrap every streamed message.
    plain = dataclasses.replace(security, token=None)
    channel = plain.aio_channel(config.address, _CHANNEL_OPTIONS)
    target: Target = (RouterTarget if config.backend == "router" else WorkerTarget)(
        channel, security.metadata(), config)
    try:
        facts = await _server_facts(target, config)
        space = token_space(facts, codec)
        text_codec = codec if config.prompt_format == "text" else None
        await _warm_up(target, config, space, text_codec, emit)
        runs = []
        index = 0
        for rate in config.request_rates:
            for concurrency in config.max_concurrencies:
                seed = config.seed + index  # a fresh dataset per run: no run finds the previous one's prefixes
                index += 1
                workload = build_workload(config.dataset, space, seed, text_codec)
                if config.flush_cache and not await target.flush_cache():
                    raise BenchError("FlushCache failed (requests were still running on the worker)")
                emit(f"#run {index}: {config.dataset.num_requests} requests, request rate "
                     f"{'inf' if math.isinf(rate) else rate}, max concurrency {concurrency or 'not set'}")
                result = await _execute(target, workload, rate, concurrency, seed, text_codec)
                metrics = summarize(result)
                emit(report(config, result, metrics))
                runs.append((result, metrics))
        return BenchOutcome(runs, facts.model)
    finally:
        await channel.close()


async def _server_facts(target: Target, config: BenchConfig) -> ServerFacts:
    """GetModelInfo, retried while the server is unavailable for up to --wait-for-server seconds."""
    import grpc

    deadline = time.monotonic() + config.wait_for_server
    while True:
        try:
            return await target.facts()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
                raise BenchError(f"cannot reach the {config.backend} at {config.address}: "
                                 f"{exc.code().name}: {exc.details()}") from None
        await asyncio.sleep(0.2)


async def _warm_up(target: Target, config: BenchConfig, space: ds.TokenSpace, codec: ds.TextCodec | None,
                   emit: Any) -> None:
    """A few short requests on prompts no run uses (they would warm its cache)."""
    if not config.warmup_requests:
        return
    emit(f"Starting warmup with {config.warmup_requests} request(s) ...")
    seed = config.seed ^ 0x5EED
    warm = build_workload(DatasetConfig(num_prompts=config.warmup_requests, random_input_len=16, random_output_len=4,
                                        random_range_ratio=1.0), space, seed, codec)
    for i, r in enumerate(warm.requests):
        prompt = r.prompt
        rec = RequestRecord(index=i, expected_output_len=r.output_len, input_len=len(prompt.ids))
        await target.generate(prompt, r.output_len, rec, keep_output=False)
        if not rec.ok:
            raise BenchError(f"warm-up request failed: {rec.status}: {rec.error}")
    emit("Warmup completed.")


def write_results(path: Path, lines: Sequence[dict[str, Any]]) -> None:
    """Append one JSON object per run (JSONL, like sglang's --output-file)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, allow_nan=False) + "\n")
