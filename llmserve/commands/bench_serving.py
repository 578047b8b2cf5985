"""`llmserve bench-serving`: online serving benchmark (sglang's bench_serving) against a router or
straight against one worker.

    llmserve bench-serving --backend router --address 127.0.0.1:30000 --dataset random \\
        --random-input-len 128 --random-output-len 128 --random-range-ratio 1 --num-prompts 64 \\
        --max-concurrency 16 64 --output-file results.jsonl
    llmserve bench-serving --backend worker --address 127.0.0.1:30001 --model DIR \\
        --dataset shared-prefix --num-prefixes 4 --prefix-len 512 --suffix-len 64 --output-len 32

docs/bench-serving.md describes the datasets, the metrics and the results file.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from llmserve.security_args import add_client_args


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (inf: all at once)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf: all at once), got {text}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("bench-serving", help="online serving benchmark against a router or a worker",
                              description="Send a generated workload to a router (llmserve.v1.Router) or one worker "
                              "(SglangScheduler) and report TTFT, TPOT, ITL, E2E latency and throughput.")
    t = p.add_argument_group("target")
    t.add_argument("--backend", choices=("router", "worker"), default="router")
    t.add_argument("--address", required=True, metavar="HOST:PORT", help="the router's or the worker's address")
    t.add_argument("--model", default=None, metavar="DIR",
                   help="the model folder: its tokenizer makes text prompts (--prompt-format text) and keeps "
                   "special tokens out of random ids")
    t.add_argument("--served-model-name", default="", help="router: the `model` field of each request")
    t.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="ids: send token ids; text: send text (the router tokenizes it; for a worker it is "
                   "tokenized here with --model, as a router would)")
    t.add_argument("--wait-for-server", type=float, default=0.0, metavar="S",
                   help="retry while the server is unavailable for up to S seconds (default: fail at once)")
    add_client_args(t)
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=("random", "shared-prefix", "multi-turn"), default="random")
    d.add_argument("--num-prompts", type=int, default=100, help="requests (random, shared-prefix)")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [ratio * len, len] (1: fixed)")
    d.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    d.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per prefix")
    d.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: tokens of each request's own suffix")
    d.add_argument("--num-conversations", type=int, default=8, help="multi-turn: chats")
    d.add_argument("--turns", type=int, default=4, help="multi-turn: requests per chat")
    d.add_argument("--turn-len", type=int, default=64, help="multi-turn: tokens of each new user message")
    d.add_argument("--output-len", type=int, default=32, help="shared-prefix, multi-turn: tokens per answer")
    d.add_argument("--seed", type=int, default=1, help="datasets and arrival times (run i uses seed + i)")
    r = p.add_argument_group("load")
    r.add_argument("--request-rate", type=_rate, nargs="+", default=[float("inf")], metavar="RATE",
                   help="Poisson arrivals per second (inf: all at once); several values: one run each")
    r.add_argument("--max-concurrency", type=int, nargs="+", default=None, metavar="N",
                   help="at most N requests in flight (several values: one run each)")
    r.add_argument("--warmup-requests", type=int, default=1, help="short requests before the runs (not counted)")
    r.add_argument("--request-timeout", type=float, default=None, metavar="S", help="deadline of each request")
    r.add_argument("--flush-cache", action="store_true", help="worker: FlushCache before each run")
    r.add_argument("--start-at", type=float, default=None, metavar="UNIX_S",
                   help="start the first run at this wall-clock time (after connecting and warming up): clients "
                   "given the same time start together")
    s = p.add_argument_group("sampling")
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the requested output length (default on)")
    s.add_argument("--temperature", type=float, default=0.0)
    o = p.add_argument_group("output")
    o.add_argument("--output-file", type=Path, default=None, help="append one JSON line per run")
    o.add_argument("--output-details", action="store_true", help="also write every request's record")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmserve.bench.serving import BenchConfig, BenchError, DatasetConfig, run_benchmark
    from llmserve.bench.serving_report import result_line, write_results
    from llmserve.security import SecurityConfigError
    from llmserve.security_args import client_security_from_args

    try:
        dataset = DatasetConfig(
            name=args.dataset, num_prompts=args.num_prompts, random_input_len=args.random_input_len,
            random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
            num_prefixes=args.num_prefixes, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
            num_conversations=args.num_conversations, turns=args.turns, turn_len=args.turn_len,
            output_len=args.output_len)
        config = BenchConfig(
            backend=args.backend, address=args.address, dataset=dataset, model_dir=args.model,
            request_rates=tuple(args.request_rate), max_concurrencies=tuple(args.max_concurrency or [None]),
            seed=args.seed, prompt_format=args.prompt_format, ignore_eos=args.ignore_eos,
            temperature=args.temperature, served_model=args.served_model_name,
            warmup_requests=args.warmup_requests, request_timeout=args.request_timeout,
            flush_cache=args.flush_cache, security=client_security_from_args(args),
            output_file=args.output_file, output_details=args.output_details,
            wait_for_server=args.wait_for_server, start_at=args.start_at)
    except (ValueError, SecurityConfigError) as exc:
        print(f"llmserve bench-serving: {exc}", file=sys.stderr)
        return 2
    codec = None
    if config.model_dir:
        from tokenizer_svc.tokenizer import ModelTokenizer

        try:
            codec = ModelTokenizer.from_dir(config.model_dir)
        except (OSError, ValueError) as exc:
            print(f"llmserve bench-serving: --model: {exc}", file=sys.stderr)
            return 2
    try:
        outcome = asyncio.run(run_benchmark(config, codec, emit=lambda line: print(line, flush=True)))
    except BenchError as exc:
        print(f"llmserve bench-serving: {exc}", file=sys.stderr)
        return 1
    if config.output_file is not None:
        settings = config.describe(outcome.model)
        write_results(config.output_file, [result_line(settings, r, m, config.output_details) for r, m in outcome.runs])
    if not outcome.all_ok:
        print("llmserve bench-serving: some requests failed (see the report)", file=sys.stderr)
    return 0 if outcome.all_ok else 1
