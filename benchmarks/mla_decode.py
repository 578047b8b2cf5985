"""MLA decode step time, absorbed vs normal, on one loaded DeepSeek-V2 folder, interleaved.

    python benchmarks/mla_decode.py --model /tmp/ds_bench [--contexts 256 1024 4096] [--batch 1]
        [--steps 2] [--rounds 3] [--threads 2]

For each context: prefill a static batch of random prompts (``context - rounds * 2 * steps`` tokens, so
the last decode step attends over at most ``context`` tokens; the prefill's tokens/s is reported too),
then alternate rounds of ``steps`` decode steps in each mode (the order flips every round) on the same
cache. Reports the median step time per mode and normal / absorbed. The mode is the backend's
``mla_decode`` attribute, switched between steps: the same weights, pool and batch serve both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmserve.bench.driver import StaticBatch
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.model_runner import ModelRunner

MODES = ("absorbed", "normal")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="decode steps per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    longest = max(args.contexts)
    runner = ModelRunner(EngineConfig(
        model_path=args.model, dtype=args.dtype, max_total_tokens=args.batch * longest + 16,
        max_running_requests=args.batch, context_length=longest,
    ))
    backend = runner.attn_backend
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    print(f"model {args.model} dtype {runner.dtype} batch {args.batch} threads {args.threads}")
    print("| context | prefill tokens/s | absorbed step | normal step | normal / absorbed |")
    print("|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        decode_steps = args.rounds * len(MODES) * args.steps
        prompt_len = context - decode_steps
        batch = StaticBatch(runner, args.batch)
        try:
            prompts = torch.randint(0, vocab, (args.batch, prompt_len), generator=gen).tolist()
            start = time.perf_counter()
            logits = batch.extend(prompts)
            prefill_tps = args.batch * prompt_len / (time.perf_counter() - start)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for r in range(args.rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    backend.mla_decode = mode
                    for _ in range(args.steps):
                        ids = logits.argmax(-1)
                        start = time.perf_counter()
                        logits = batch.decode(ids)
                        times[mode].append(time.perf_counter() - start)
        finally:
            batch.release()
        a, n = (statistics.median(times[m]) for m in MODES)
        print(f"| {context} | {prefill_tps:.0f} | {a * 1e3:.1f} ms | {n * 1e3:.1f} ms | {n / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
