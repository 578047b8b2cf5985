"""One layer's extend (prefill) attention: SDPA's flash kernel (attention/sdpa.py, the path before) against
this project's flash kernel (kernels/csrc/extend_attention_avx512.cpp) on AVX512-BF16 and, where the CPU has
AMX-BF16, on AMX tiles; bf16, interleaved in rounds on the same threads; per shape the median over rounds of
each side's best of N calls, with the causal attention's FLOPs (2 (Dk + Dv) per query head and visible key)
per second.

    python benchmarks/extend_attention.py [--threads 2] [--rounds 3] [--calls 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from worker_svc.attention.sdpa import attend_tokens_first
from worker_svc.kernels import cpu_ext

# tokens, cached prefix, query heads, kv heads, key head dim, value head dim
SHAPES = [
    (128, 0, 9, 3, 64, 64),  # SmolLM2-135M: a 128-token prompt
    (512, 0, 9, 3, 64, 64),  # a 512-token prompt
    (1024, 0, 9, 3, 64, 64),
    (64, 512, 9, 3, 64, 64),  # a 64-token suffix over a cached 512-token prefix (the shared-prefix workload)
    (512, 0, 32, 8, 128, 128),  # Llama-3-8B's heads
    (512, 0, 16, 16, 192, 128),  # DeepSeek-V2-Lite's MLA heads (extend decompresses K and V)
]


def best_of(fn: Callable[[], object], calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(ops: object, shape: tuple[int, ...], rounds: int, calls: int, gen: torch.Generator, amx: bool) -> str:
    """One table row: SDPA and our paths alternated for `rounds` rounds on one shape."""
    tokens, prefix, heads, kv_heads, dk, dv = shape
    context = prefix + tokens
    q = torch.randn(tokens, heads, dk, generator=gen).bfloat16()
    k = torch.randn(context, kv_heads, dk, generator=gen).bfloat16()
    v = torch.randn(context, kv_heads, dv, generator=gen).bfloat16()
    scale = dk**-0.5
    mask = torch.ones(tokens, context, dtype=torch.bool).tril(diagonal=prefix) if prefix else None
    sides: dict[str, Callable[[], object]] = {
        "sdpa": lambda: attend_tokens_first(q, k, v, scale=scale, attn_mask=mask, is_causal=mask is None,
                                            enable_gqa=heads != kv_heads),
        "avx512_bf16": lambda: ops.extend_attention(q, k, v, None, prefix, scale, impl=1),  # type: ignore[attr-defined]
    }
    if amx:
        sides["amx_bf16"] = lambda: ops.extend_attention(q, k, v, None, prefix, scale, impl=2)  # type: ignore[attr-defined]
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            times[name].append(best_of(sides[name], calls))
    medians = {name: statistics.median(t) for name, t in times.items()}
    flops = 2 * heads * (dk + dv) * sum(prefix + t + 1 for t in range(tokens))
    cells = [f"{medians[name] * 1e3:.2f} ({flops / medians[name] / 1e9:.0f})" for name in sides]
    ratios = [f"{medians['sdpa'] / medians[name]:.2f}x" for name in list(sides)[1:]]
    return f"| {tokens} / {prefix} | {heads} / {kv_heads} x {dk} / {dv} | " + " | ".join(cells + ratios) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=7)
    args = parser.parse_args()
    ops = cpu_ext.load()
    if ops is None or not ops.extend_attention_available():  # type: ignore[attr-defined]
        raise SystemExit("this CPU lacks AVX512-BF16 (or the C++ kernels did not build): nothing to compare")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    amx = bool(ops.extend_attention_amx_available())  # type: ignore[attr-defined]
    ours = ["avx512_bf16", "amx_bf16"] if amx else ["avx512_bf16"]
    columns = ["SDPA ms (GFLOP/s)"] + [f"{name} ms (GFLOP/s)" for name in ours] + [f"SDPA / {name}" for name in ours]
    print("| tokens / prefix | heads (q / kv) x dims (k / v) | " + " | ".join(columns) + " |")
    print("|---|---|" + "---:|" * (1 + 2 * len(ours)))
    for shape in SHAPES:
        print(measure(ops, shape, args.rounds, args.calls, gen, amx))


if __name__ == "__main__":
    main()
