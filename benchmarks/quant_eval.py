"""Quantization against bf16 on one model folder: accuracy (mean KL, top-1 agreement over
teacher-forced positions) and decode speed, every config measured interleaved in one process.

    python benchmarks/quant_eval.py --model /tmp/m/bench [--configs int8wo int4wo-128 int8dq int8wo+head]
        [--cpu-quant-kernel auto|avx2|aten]

A config name ending in ``+head`` also quantizes the LM head (``--quantize-lm-head``); one ending
in ``@aten`` or ``@avx2`` picks that kernel set (``--cpu-quant-kernel``), e.g. ``int4wo-128@aten``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmserve.bench.driver import StaticBatch
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.model_runner import ModelRunner


def teacher_forced_logits(runner: ModelRunner, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [batch, length]: logits [batch * (length - prefix), vocab] at every position after a
    16-token prefill, by decoding the given tokens one at a time."""
    batch = StaticBatch(runner, tokens.shape[0])
    try:
        out = [batch.extend(tokens[:, :16].tolist())]
        for pos in range(16, tokens.shape[1] - 1):
            out.append(batch.decode(tokens[:, pos]))
        return torch.stack(out, dim=1).flatten(0, 1)
    finally:
        batch.release()


def decode_step_time(runner: ModelRunner, batch_size: int, input_len: int, steps: int) -> float:
    prompts = torch.randint(
        0, runner.config.vocab_size, (batch_size, input_len), generator=torch.Generator().manual_seed(1)
    )
    batch = StaticBatch(runner, batch_size)
    try:
        logits = batch.extend(prompts.tolist())
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            logits = batch.decode(logits.argmax(-1))
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        batch.release()


def engine_config(model: str, name: str, cpu_quant_kernel: str) -> EngineConfig:
    config, _, kernel = name.partition("@")
    return EngineConfig(
        model_path=model,
        dtype="bfloat16",
        max_total_tokens=8192,
        torchao_config=config.removesuffix("+head"),
        quantize_lm_head=config.endswith("+head"),
        cpu_quant_kernel=kernel or cpu_quant_kernel,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--configs", nargs="+", default=["int8wo", "int4wo-128", "int8dq"])
    parser.add_argument("--positions", type=int, default=256, help="teacher-forced positions (>= 256)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--cpu-quant-kernel", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--speed-only", action="store_true", help="skip the accuracy pass")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runners = {
        name: ModelRunner(engine_config(args.model, name, args.cpu_quant_kernel)) for name in ["none", *args.configs]
    }
    if not args.speed_only:
        report_accuracy(runners, args.configs, args.positions)
    report_speed(runners, args.batch_sizes, args.rounds, args.steps)


def report_accuracy(runners: dict[str, ModelRunner], configs: list[str], positions: int) -> None:
    seqs = 8
    length = 16 + positions // seqs + 1
    tokens = torch.randint(
        0, runners["none"].config.vocab_size, (seqs, length), generator=torch.Generator().manual_seed(0)
    )
    base = teacher_forced_logits(runners["none"], tokens).float()
    base_logp = base.log_softmax(-1)
    print(f"accuracy vs bf16 over {base.shape[0]} positions")
    for name in configs:
        logits = teacher_forced_logits(runners[name], tokens).float()
        kl = (base_logp.exp() * (base_logp - logits.log_softmax(-1))).sum(-1).mean().item()
        top1 = (logits.argmax(-1) == base.argmax(-1)).float().mean().item()
        cos = torch.nn.functional.cosine_similarity(logits, base, dim=-1).mean().item()
        print(
            f"  {name:18s} mean KL {kl:.5f}  top-1 agreement {top1:.3f}  logits cosine {cos:.4f}  "
            f"weight bytes {runners[name].weight_nbytes / 2**20:.1f} MiB "
            f"(bf16 {runners['none'].weight_nbytes / 2**20:.1f})"
        )


def report_speed(runners: dict[str, ModelRunner], batch_sizes: list[int], rounds: int, steps: int) -> None:
    for bs in batch_sizes:
        best = {name: float("inf") for name in runners}
        for _ in range(rounds):
            for name, runner in runners.items():
                best[name] = min(best[name], decode_step_time(runner, bs, 128, steps))
        print(f"decode step, batch {bs}, input 128 (best of {rounds} interleaved medians):")
        for name, t in best.items():
            print(f"  {name:18s} {t * 1e3:7.2f} ms  {bs / t:7.1f} tok/s  speed-up vs bf16 {best['none'] / t:.2f}x")


if __name__ == "__main__":
    main()
