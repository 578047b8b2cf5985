"""The serving benchmark behind `llmserve bench-serving` (sglang's bench_serving over gRPC): its
configuration, each run's workload and the run itself.

One grpc.aio channel, one asyncio task per request; requests leave on a Poisson schedule (or all at
once) and, with a concurrency cap, wait for a free slot first (the latency clock starts when the
request is sent, as sglang's). Targets (router or worker) are serving_targets.py, what is measured
serving_stats.py, the printout and the JSONL serving_report.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmserve.bench import datasets as ds
from llmserve.bench.serving_report import report
from llmserve.bench.serving_stats import RequestRecord, RunResult, summarize
from llmserve.bench.serving_targets import RequestSettings, RouterTarget, ServerFacts, Target, WorkerTarget

if TYPE_CHECKING:  # grpc loads when a run starts, not when the CLI parses flags
    from llmserve.security import ChannelSecurity

BACKENDS = ("router", "worker")
DATASETS = ("random", "shared-prefix", "multi-turn")
PROMPT_FORMATS = ("ids", "text")
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
    start_at: float | None = None  # Unix time of the first run's start (after warm-up): clients started together

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
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout: must be > 0, got {self.request_timeout}")
        if self.wait_for_server < 0:
            raise ValueError(f"--wait-for-server: must be >= 0, got {self.wait_for_server}")
        if self.temperature < 0:
            raise ValueError(f"--temperature: must be >= 0, got {self.temperature}")
        if self.start_at is not None and not self.start_at > 0:
            raise ValueError(f"--start-at: a Unix time in seconds, got {self.start_at}")

    @property
    def request_settings(self) -> RequestSettings:
        return RequestSettings(temperature=self.temperature, ignore_eos=self.ignore_eos,
                               served_model=self.served_model, request_timeout=self.request_timeout)

    def describe(self, model: str) -> dict[str, Any]:
        """The settings a results line records (`model`: the name the server reported)."""
        return {"backend": self.backend, "address": self.address, "model": model,
                "dataset": self.dataset.describe(), "prompt_format": self.prompt_format,
                "ignore_eos": self.ignore_eos, "temperature": self.temperature}


# ---- one run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A run's prompts: single requests, or conversations (multi-turn)."""

    requests: tuple[ds.BenchRequest, ...] = ()
    conversations: tuple[ds.Conversation, ...] = ()


def build_workload(cfg: DatasetConfig, space: ds.TokenSpace, seed: int,
                   codec: ds.TextCodec | None = None) -> Workload:
    """The dataset of one run; with `codec` (the tokenizer) as text prompts, in which case `space`
    should be ds.text_space's (ids whose text is whole characters)."""
    maker = ds.TextMaker(codec, space, random.Random(seed ^ 0x7E47)) if codec is not None else None
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


async def _execute(target: Target, workload: Workload, rate: float, concurrency: int | None, seed: int,
                   codec: ds.TextCodec | None) -> RunResult:
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    records: list[RequestRecord]

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
        channel, security.metadata(), config.request_settings)
    try:
        deadline = time.monotonic() + config.wait_for_server  # one --wait-for-server for both waits
        facts = await _server_facts(target, config, deadline)
        await _wait_serving(channel, config, deadline)
        space = token_space(facts, codec)
        text_codec = codec if config.prompt_format == "text" else None
        if text_codec is not None:
            space = ds.text_space(space, text_codec)
        await _warm_up(target, config, space, text_codec, emit)
        if config.start_at is not None:
            await _sleep_until(config.start_at, emit)
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
                emit(report(config.backend, config.dataset.name, result, metrics))
                runs.append((result, metrics))
        return BenchOutcome(runs, facts.model)
    finally:
        await channel.close()


async def _sleep_until(start_at: float, emit: Any) -> None:
    """Wait for the wall clock to reach ``start_at`` (--start-at): two clients given the same time send their
    first requests together, whatever their own start-up took (benchmarks/router_overhead.sh)."""
    late = time.time() - start_at
    if late > 0:
        emit(f"--start-at: {late:.3f} s late, starting now")
        return
    await asyncio.sleep(-late)


async def _server_facts(target: Target, config: BenchConfig, deadline: float) -> ServerFacts:
    """GetModelInfo, retried while the server is unavailable until ``deadline`` (--wait-for-server)."""
    import grpc

    while True:
        try:
            return await target.facts()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
                raise BenchError(f"cannot reach the {config.backend} at {config.address}: "
                                 f"{exc.code().name}: {exc.details()}") from None
        await asyncio.sleep(0.2)


async def _wait_serving(channel: Any, config: BenchConfig, deadline: float) -> None:
    """With --wait-for-server, also wait until the server's grpc.health says SERVING: a router answers
    GetModelInfo from its tokenizer before its worker groups are up. A server without the health service
    is taken as ready."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if not config.wait_for_server:
        return
    stub = health_pb2_grpc.HealthStub(channel)
    while True:
        try:
            status = (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return
            status = None
        if status == health_pb2.HealthCheckResponse.SERVING:
            return
        if time.monotonic() >= deadline:
            raise BenchError(f"the {config.backend} at {config.address} did not become SERVING within "
                             f"--wait-for-server {config.wait_for_server:g} s")
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
