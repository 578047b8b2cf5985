"""Time the sampler on one step's logits: the fused CPU race (kernels/csrc/sampling_race.cpp) against the same
Sampler on tensor ops (sampling/noise.py), and the way it sampled before both (a torch.Generator per request,
V uniforms each, exp / log / divide / argmax over float copies), interleaved, best of N rounds.

    python benchmarks/sampling.py [--vocab 49152] [--batches 1 16 64] [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from worker_svc.kernels import cpu_ext
from worker_svc.sampling import Sampler, SamplingBatch, SamplingParams, noise_key

# Each case's rows cycle through its parameters.
CASES = {
    "temperature 1": [SamplingParams(temperature=1.0)],
    "temperature 0.7, top_p 0.9": [SamplingParams(temperature=0.7, top_p=0.9)],
    "temperature 1, top_p 0.95": [SamplingParams(temperature=1.0, top_p=0.95)],
    "top_k 50": [SamplingParams(temperature=1.0, top_k=50)],
    "greedy / T 0.7 top_p 0.9": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9)],
}


def generator_race(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The sampler before counter-based noise, temperature 1 without truncation: per-row mt19937 uniforms."""
    x = logits.float()
    u = torch.empty_like(x)
    for row, g in enumerate(generators):
        torch.rand(x.shape[1], generator=g, out=u[row])
    e = (x - x.amax(dim=-1, keepdim=True)).exp_()
    return e.div_(u.clamp_min_(torch.finfo(torch.float32).tiny).log_().neg_()).argmax(dim=-1)


def best_of(rounds: int, fn: Callable[..., object], *args: object, calls: int = 5) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ext.load()
    fused, plain = Sampler(fused_ops=ops), Sampler()  # type: ignore[arg-type]
    print(f"vocab {args.vocab}, {args.threads} threads, fused kernels {'on' if ops is not None else 'unavailable'}")
    for B in args.batches:
        logits = torch.randn(B, args.vocab, generator=torch.Generator().manual_seed(B)).mul_(3).to(torch.bfloat16)
        for label, params in CASES.items():
            rows = [params[i % len(params)] for i in range(B)]
            batch = SamplingBatch.build(rows, [noise_key(i) for i in range(B)], [[0] * 8] * B, [[1]] * B, frozenset(),
                                        args.vocab, "cpu")
            row = f"bs {B:3d} {label:28s}"
            if ops is not None:
                row += f" fused {best_of(args.rounds, fused.sample, logits, batch):7.2f} ms"
            row += f"  tensor ops {best_of(args.rounds, plain.sample, logits, batch):7.2f} ms"
            if label == "temperature 1":
                gens = [torch.Generator().manual_seed(i) for i in range(B)]
                row += f"  per-request generators {best_of(args.rounds, generator_race, logits, gens):7.2f} ms"
            print(row, flush=True)


if __name__ == "__main__":
    main()
