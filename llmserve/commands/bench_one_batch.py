"""`llmserve bench-one-batch`: static-batch latency and an HF-checked correctness mode (sglang's
bench_one_batch and reference_hf.py in one command)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llmserve.commands.engine_args import (
    add_engine_args,
    add_heap_policy_arg,
    apply_heap_policy_logged,
    engine_config_from_args,
)
from worker_svc.config.tp_comm import TP_COMM_CHOICES, TP_COMM_HELP

if TYPE_CHECKING:  # torch is imported when the command runs, not when the CLI parses arguments
    import torch

    from worker_svc.executor.step_runner import StepRunner
    from worker_svc.parallel.collective_observer import CollectiveRecorder

# The three prompts of sglang's bench_one_batch --correct.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "The capital of the United Kindom is",
    "Today is a sunny day and I like",
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("bench-one-batch", help="static-batch latency, or --correct against HF")
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, nargs="+", default=[128])
    p.add_argument("--output-len", type=int, nargs="+", default=[16])
    p.add_argument("--correct", action="store_true", help="greedy-decode prompts and compare with HF")
    p.add_argument("--prompts-file", type=Path, default=None, help="one prompt per line (with --correct)")
    p.add_argument("--cut-len", type=int, default=4, help="--correct: tokens prefilled before the extend")
    p.add_argument("--logits-atol", type=float, default=None,
                   help="--correct: max |ours - HF| (fp32); default 1e-4 on the CPU, 5e-4 on a GPU, whose GEMMs "
                        "sum in another order than the CPU reference's (seen: 1.1e-4 on logits of magnitude 44, "
                        "an H200)")
    p.add_argument("--min-cosine", type=float, default=0.999, help="--correct: logits cosine (bf16)")
    p.add_argument("--compare-hf", action="store_true", help="latency: interleave HF generate, report ratio")
    p.add_argument("--repeats", type=int, default=1, help="latency: measurements per setting")
    p.add_argument("--result-file", type=Path, default=None, help="write results as JSON")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (per rank)")
    p.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks: this process leads, N-1 followers are spawned")
    p.add_argument("--tp-comm", choices=TP_COMM_CHOICES, default="auto", help=TP_COMM_HELP)
    p.add_argument("--tp-init-addr", default=None, metavar="HOST:PORT",
                   help="--tp: rendezvous address (default: a free port on 127.0.0.1)")
    p.add_argument("--profile-collectives", action="store_true",
                   help="--tp: time the leader's collectives (all-reduce, all-gather, step broadcast) per step")
    add_heap_policy_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from llmserve.bench.runners import open_runner
    from worker_svc.executor.compute_priority import lower_compute_priority
    from worker_svc.parallel.collective_observer import CollectiveRecorder

    apply_heap_policy_logged(args.malloc_mmap_threshold)  # every rank's steps allocate as the worker's do
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = engine_config_from_args(args)
    lower_compute_priority(engine.compute_nice)  # this thread runs the steps (rank 0's)
    if args.tp < 1:
        raise SystemExit("--tp must be at least 1")
    # A single rank performs no collectives: nothing to profile.
    profiler = CollectiveProfiler(CollectiveRecorder()) if args.profile_collectives and args.tp > 1 else None
    observer = profiler.recorder if profiler is not None else None
    with open_runner(engine, args.tp, args.tp_init_addr, args.threads, observer=observer,
                     tp_comm=args.tp_comm, heap_policy=args.malloc_mmap_threshold) as runner:
        return correctness(runner, args) if args.correct else latency(runner, args, profiler)


class CollectiveProfiler:
    """The leader's collectives per step (all-reduce, all-gather, step broadcast), read from the
    recorder that observes its TPContext. Times are issue to done (every collective of a step is
    synchronous today, so that is the time the step spent in it)."""

    def __init__(self, recorder: CollectiveRecorder) -> None:
        self.recorder = recorder

    def reset(self) -> None:
        self.recorder.clear()

    def per_step(self, steps: int) -> dict:
        """{op: {"calls", "ms", "bytes"} per step} plus the total over all ops."""
        out = {
            op: {"calls": s.count / steps, "ms": s.total_ns / 1e6 / steps, "blocked_ms": s.blocked_ns / 1e6 / steps,
                 "bytes": s.nbytes / steps}
            for op, s in self.recorder.summary().items()
        }
        out["total"] = {key: sum(v[key] for v in out.values()) for key in ("calls", "ms", "blocked_ms", "bytes")}
        return out


# ---- correctness ----------------------------------------------------------------------------------


def _load_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file is None:
        return list(DEFAULT_PROMPTS)
    return [line for line in args.prompts_file.read_text().splitlines() if line.strip()]


def logits_atol(given: float | None, device: torch.device) -> float:
    """The fp32 oracle's max |ours - HF| on the final prefill logits. HF runs on the CPU: on a GPU the
    same fp32 sums run in another order (cuBLAS's split-K and tiling), worth a few ulps of logits of
    magnitude ~50, so the default there is looser; greedy tokens must still be equal."""
    if given is not None:
        return given
    return 1e-4 if device.type == "cpu" else 5e-4


def correctness(runner: StepRunner, args: argparse.Namespace) -> int:
    import torch
    from tokenizers import Tokenizer

    from llmserve.bench.driver import greedy_with_split_prefill
    from llmserve.bench.reference_hf import hf_greedy

    tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    texts = _load_prompts(args)
    prompts = [tokenizer.encode(text).ids for text in texts]
    output_len = args.output_len[0]
    logits, outputs = greedy_with_split_prefill(runner, prompts, output_len, args.cut_len)
    logits = logits.cpu()  # HF's reference runs on the CPU
    ref_logits, ref_outputs = hf_greedy(args.model, prompts, output_len)
    exact = runner.dtype == torch.float32
    atol = logits_atol(args.logits_atol, runner.device)
    ok = True
    records = []
    for i, text in enumerate(texts):
        diff = (logits[i] - ref_logits[i]).abs().max().item()
        cosine = torch.nn.functional.cosine_similarity(logits[i], ref_logits[i], dim=0).item()
        same = sum(a == b for a, b in zip(outputs[i], ref_outputs[i], strict=False))
        print(f"========== Prompt {i} ==========")
        with torch.inference_mode():
            torch.set_printoptions(threshold=16, edgeitems=3, precision=4)
            print(f"prefill logits (final) {logits[i]}")
            torch.set_printoptions(profile="default")
        print(tokenizer.decode(prompts[i] + outputs[i], skip_special_tokens=False))
        print(f"max |ours - HF| {diff:.3e}  cosine {cosine:.6f}  greedy tokens equal to HF {same}/{output_len}")
        passed = (diff <= atol and outputs[i] == ref_outputs[i]) if exact else cosine >= args.min_cosine
        ok &= passed
        records.append({
            "prompt": text, "input_ids": prompts[i], "prefill_logits": logits[i].tolist(),
            "output_ids": outputs[i], "hf_output_ids": ref_outputs[i], "max_abs_diff": diff, "cosine": cosine,
        })
    if args.result_file:
        args.result_file.write_text(json.dumps({"dtype": str(runner.dtype), "prompts": records}))
    print("Correctness check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


# ---- latency --------------------------------------------------------------------------------------


def _timed_run(runner: StepRunner, batch_size: int, input_len: int, output_len: int, quiet: bool,
               profiler: CollectiveProfiler | None = None) -> dict:
    import torch

    from llmserve.bench.driver import StaticBatch

    # CUDA queues kernels and returns: a step is timed to the end of its work.
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompts = torch.randint(0, vocab, (batch_size, input_len), generator=generator).tolist()
    comm: dict = {}
    batch = StaticBatch(runner, batch_size)
    try:
        if profiler is not None:
            profiler.reset()
        sync()
        start = time.perf_counter()
        logits = batch.extend(prompts)
        sync()
        prefill = time.perf_counter() - start
        if profiler is not None:
            comm["prefill"] = profiler.per_step(1)
            profiler.reset()
        if not quiet:
            print(f"Prefill. latency: {prefill:6.5f} s, throughput: {batch_size * input_len / prefill:9.2f} token/s")
        decode_times = []
        for step in range(output_len - 1):
            tick = time.perf_counter()
            logits = batch.decode(logits.argmax(dim=-1))
            sync()
            decode_times.append(time.perf_counter() - tick)
            if not quiet and step < 5:
                print(f"Decode.  latency: {decode_times[-1]:6.5f} s, "
                      f"throughput: {batch_size / decode_times[-1]:9.2f} token/s")
        total = time.perf_counter() - start
        if profiler is not None and decode_times:
            comm["decode"] = profiler.per_step(len(decode_times))
    finally:
        batch.release()
    median = statistics.median(decode_times) if decode_times else float("nan")
    if not quiet:
        print(f"Decode.  median latency: {median:6.5f} s, median throughput: {batch_size / median:9.2f} token/s")
        print(f"Total. latency: {total:6.3f} s, throughput: "
              f"{batch_size * (input_len + output_len) / total:9.2f} token/s")
    for phase, stats in comm.items():
        step_ms = 1e3 * (prefill if phase == "prefill" else statistics.mean(decode_times))
        if not quiet:
            total = stats["total"]
            # Under two-batch overlap a collective's span runs beside compute: only the blocked part costs.
            hidden = 1 - total["blocked_ms"] / total["ms"] if total["ms"] else 0.0
            print(f"Collectives ({phase}, per step): " + ", ".join(
                f"{k} {v['calls']:.0f} x = {v['ms']:.2f} ms" for k, v in stats.items())
                + f" of {step_ms:.2f} ms ({100 * total['ms'] / step_ms:.0f}%); blocked {total['blocked_ms']:.2f} ms"
                f" ({100 * total['blocked_ms'] / step_ms:.0f}%), hidden {100 * hidden:.0f}%")
        stats["step_ms"] = step_ms
    return {
        "collectives": comm,
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "prefill_latency": prefill, "prefill_throughput": batch_size * input_len / prefill,
        "median_decode_latency": median, "median_decode_throughput": batch_size / median,
        "total_latency": total,
    }


def latency(runner: StepRunner, args: argparse.Namespace, profiler: CollectiveProfiler | None = None) -> int:
    hf = None
    if args.compare_hf:
        from llmserve.bench.hf_generate import HFGenerateTimer

        hf = HFGenerateTimer(args.model, runner.dtype)
    print("Warmup ...")
    _timed_run(runner, args.batch_size[0], args.input_len[0], min(4, args.output_len[0]), quiet=False,
               profiler=profiler)
    print("Benchmark ...")
    results = []
    for bs in args.batch_size:
        for il in args.input_len:
            for ol in args.output_len:
                if bs * (il + ol) > runner.kv.allocator.size:
                    print(f"skip bs={bs} input={il} output={ol}: exceeds the KV pool", file=sys.stderr)
                    continue
                for _ in range(args.repeats):
                    result = _timed_run(runner, bs, il, ol, quiet=False, profiler=profiler)
                    if hf is not None:
                        hf_step = hf.decode_step_latency(bs, il, ol)
                        result["hf_median_decode_latency"] = hf_step
                        result["decode_speedup_vs_hf"] = hf_step / result["median_decode_latency"]
                        print(f"HF generate decode latency: {hf_step:6.5f} s -> ours is "
                              f"{result['decode_speedup_vs_hf']:.2f}x faster")
                    results.append(result)
    if args.result_file:
        args.result_file.write_text(json.dumps(results, indent=2))
    return 0
