"""Time the bench model's linear layers (one decode step's worth) under each CPU kernel, interleaved,
best of N rounds: bf16 kernels, and the quantized kernels of worker_svc/executor/quantize.py (aten's, AVX2, AVX-512).

    python benchmarks/linear_kernels.py [--threads 2] [--rounds 6] [--rows 1 2 16] [--quantized]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from worker_svc.kernels.bf16_linear import BlockedUpcastLinear, PackedFp16Linear, fbgemm_available

# One step of the `bench` preset: 8 x (qkv, o, gate_up, down) + LM head, as (out, in).
BENCH_SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 8 + [(32000, 1024)]


def quantized_kernels(weights: list[torch.Tensor]) -> dict[str, list]:
    from worker_svc.kernels import cpu_ext
    from worker_svc.kernels.quant_linear import Int4WeightOnlyKernel, Int8DynamicKernel, Int8WeightOnlyKernel

    kernels: dict[str, list] = {}
    backends: dict[str, object | None] = {"aten": None}
    if (ops := cpu_ext.load()) is not None:
        backends["avx2"] = ops
        if ops.quant_avx512_available():
            backends["avx512"] = ops
    for backend, ops in backends.items():
        isa = "avx512" if backend == "avx512" else "avx2"
        kernels[f"int8wo/{backend}"] = [Int8WeightOnlyKernel(w, torch.bfloat16, ops=ops, isa=isa) for w in weights]
        kernels[f"int4wo-128/{backend}"] = [
            Int4WeightOnlyKernel(w, torch.bfloat16, 128, ops=ops, isa=isa) for w in weights
        ]
        if backend != "avx512":  # no AVX-512 int8dq kernel
            kernels[f"int8dq/{backend}"] = [Int8DynamicKernel(w, torch.bfloat16, ops=ops) for w in weights]
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 16])
    parser.add_argument("--quantized", action="store_true", help="also time the quantized kernels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16) for shape in BENCH_SHAPES]
    kernels = {"aten": [F.linear] * len(weights), "blocked_upcast": [BlockedUpcastLinear()] * len(weights)}
    if fbgemm_available():
        kernels["fbgemm_fp16"] = [PackedFp16Linear(w) for w in weights]
    if args.quantized:
        kernels.update(quantized_kernels(weights))
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (1024, 2816)}
        best = {name: float("inf") for name in kernels}
        for _ in range(args.rounds):
            for name, fns in kernels.items():
                start = time.perf_counter()
                for fn, w in zip(fns, weights, strict=True):
                    fn(inputs[w.shape[1]], w, None)
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"rows={rows:3d}", flush=True)
        for name, seconds in best.items():
            print(f"  {name:20s} {seconds * 1e3:8.2f} ms  {best['aten'] / seconds:5.2f}x aten bf16", flush=True)


if __name__ == "__main__":
    main()
