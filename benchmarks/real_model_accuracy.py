"""Accuracy of every dtype / quantization config on a real model and real text, HF fp32 as reference:
perplexity over the shipped text (llmserve eval-ppl's windows), top-1 agreement with our bf16 and
with HF fp32 at every scored position, and greedy-continuation agreement with HF fp32 (16 prompts
cut from the text, 64 greedy tokens each).

    python benchmarks/real_model_accuracy.py --model .models/smollm2-135m-instruct [--window 1024 --stride 512]
        [--configs fp32 bf16 int8wo int8wo+head ...] [--threads 2] [--result-file out.json]

Config names: fp32, bf16, or a --torchao-config name (bf16 activations); "+head" also quantizes
the LM head.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from llmserve.bench.driver import greedy_with_split_prefill
from llmserve.bench.reference_hf import hf_greedy
from llmserve.commands.eval_ppl import shipped_text
from llmserve.eval.perplexity import EngineScorer, HFScorer, perplexity
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.model_runner import ModelRunner

# int4wo-128 is not among them: SmolLM2's hidden size 576 is not a multiple of 128 (the engine refuses it).
DEFAULT_CONFIGS = ["fp32", "bf16"] + [q + head for q in ("int8wo", "int4wo-32", "int4wo-64", "int8dq")
                                      for head in ("", "+head")]
PROMPTS, PROMPT_LEN, CONTINUATION = 16, 48, 64


def engine_config(model: str, name: str, max_tokens: int) -> EngineConfig:
    quant = name.removesuffix("+head")
    return EngineConfig(
        model_path=model, dtype="float32" if name == "fp32" else "bfloat16", max_total_tokens=max_tokens,
        max_running_requests=PROMPTS, torchao_config="none" if quant in ("fp32", "bf16") else quant,
        quantize_lm_head=name.endswith("+head"))


def continuation_agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, float, int]:
    """(fraction of positions equal, mean tokens before the first difference, prompts identical)."""
    same = sum(a == b for o, r in zip(ours, ref, strict=True) for a, b in zip(o, r, strict=False)) / sum(
        len(r) for r in ref
    )
    prefix = [
        next((i for i, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), len(r))
        for o, r in zip(ours, ref, strict=False)
    ]
    return same, sum(prefix) / len(prefix), sum(p == len(r) for p, r in zip(prefix, ref, strict=False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ids = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json")).encode(shipped_text()).ids
    step = (len(ids) - PROMPT_LEN) // PROMPTS
    prompts = [ids[i * step : i * step + PROMPT_LEN] for i in range(PROMPTS)]

    start = time.perf_counter()
    hf_ppl = perplexity(HFScorer(args.model), ids, args.window, args.stride)
    _, hf_tokens = hf_greedy(args.model, prompts, CONTINUATION)
    print(
        f"{len(ids)} tokens, {hf_ppl.tokens_scored} scored in {hf_ppl.windows} windows of {args.window} "
        f"(stride {args.stride}); {PROMPTS} prompts x {CONTINUATION} greedy tokens",
        flush=True,
    )
    print(f"HF fp32: perplexity {hf_ppl.perplexity:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)

    rows, results = [], {}
    max_tokens = max(args.window, PROMPTS * (PROMPT_LEN + CONTINUATION))
    for name in args.configs:
        start = time.perf_counter()
        runner = ModelRunner(engine_config(args.model, name, max_tokens))
        result = perplexity(EngineScorer(runner), ids, args.window, args.stride)
        _, tokens = greedy_with_split_prefill(runner, prompts, CONTINUATION, cut_len=PROMPT_LEN)
        results[name] = result
        same, prefix, identical = continuation_agreement(tokens, hf_tokens)
        row = {
            "config": name,
            "perplexity": result.perplexity,
            "top1_vs_hf_fp32": result.top1_agreement(hf_ppl),
            "top1_vs_bf16": result.top1_agreement(results["bf16"]) if "bf16" in results else None,
            "greedy_tokens_equal_hf_fp32": same,
            "greedy_mean_prefix": prefix,
            "greedy_prompts_identical": identical,
            "weight_mib": runner.weight_nbytes / 2**20,
        }
        rows.append(row)
        print(
            f"{name:16s} ppl {row['perplexity']:8.4f}  top-1 vs bf16 "
            f"{row['top1_vs_bf16'] if row['top1_vs_bf16'] is not None else float('nan'):.4f}  vs HF fp32 "
            f"{row['top1_vs_hf_fp32']:.4f}  greedy: {same:.3f} of tokens, first difference at {prefix:.1f}, "
            f"{identical}/{PROMPTS} identical  ({row['weight_mib']:.1f} MiB, {time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        del runner
    if args.result_file:
        args.result_file.write_text(json.dumps({"hf_fp32_perplexity": hf_ppl.perplexity, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
