"""Decode attention over a padded KV gather: SDPA vs grouped matmuls, interleaved, best of N.

    python benchmarks/decode_attention.py [--threads 1] [--batch 16] [--context 160]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bsz, heads, kv_heads, dim, length = args.batch, 16, 4, 64, args.context
    groups = heads // kv_heads
    dt = torch.bfloat16
    q = torch.randn(bsz, heads, 1, dim, dtype=dt)
    k = torch.randn(bsz, kv_heads, length, dim, dtype=dt)
    v = torch.randn(bsz, kv_heads, length, dim, dtype=dt)
    mask = (torch.arange(length)[None, :] < torch.randint(length // 2, length + 1, (bsz,))[:, None])[:, None, None, :]

    def grouped() -> torch.Tensor:
        scores = torch.matmul(q.view(bsz, kv_heads, groups, dim).float(), k.float().transpose(-1, -2)) * dim**-0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.matmul(probs, v.float()).view(bsz, heads, 1, dim).to(dt)

    fns = {
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "sdpa_repeat_kv": lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask
        ),
        "grouped_matmul": grouped,
    }
    best = {name: float("inf") for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(8):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / 8)
    print("  ".join(f"{n}={t * 1e3:.3f} ms" for n, t in best.items()))


if __name__ == "__main__":
    main()
