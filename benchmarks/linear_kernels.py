"""Time the bench model's linear layers under each CPU bf16 kernel, interleaved, best of N rounds.

    python benchmarks/linear_kernels.py [--threads 2] [--rounds 6] [--rows 1 2 16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from worker_svc.layers.cpu_kernels import BlockedUpcastLinear, PackedFp16Linear, fbgemm_available

# One step of the `bench` preset: 8 x (qkv, o, gate_up, down) + LM head, as (out, in).
BENCH_SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 8 + [(32000, 1024)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16) for shape in BENCH_SHAPES]
    kernels = {"aten": [F.linear] * len(weights), "blocked_upcast": [BlockedUpcastLinear()] * len(weights)}
    if fbgemm_available():
        kernels["fbgemm_fp16"] = [PackedFp16Linear(w) for w in weights]
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (1024, 2816)}
        best = {name: float("inf") for name in kernels}
        for _ in range(args.rounds):
            for name, fns in kernels.items():
                start = time.perf_counter()
                for fn, w in zip(fns, weights):
                    fn(inputs[w.shape[1]], w, None)
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"rows={rows:3d} " + "  ".join(f"{n}={t * 1e3:7.2f} ms" for n, t in best.items()), flush=True)


if __name__ == "__main__":
    main()
