"""``attend_tokens_first``: an extend's attention in the shape that takes the CPU's flash kernel. It must
equal a dense fp32 reference (causal, a prefix mask, GQA, MLA's narrower V) and, on the CPU, run the
flash kernel rather than SDPA's math path (which 3-D inputs or a narrower V fell back to: ~2x slower at
512 tokens, docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from worker_svc.attention.sdpa import attend_tokens_first

FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


def _reference(query, keys, values, mask, scale):
    """Dense fp32 attention: query [t, h, d], keys/values [c, kv_h, *], mask [t, c] -> [t, h, v_dim]."""
    groups = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(groups, dim=1)
    v = values.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,chd->htc", query.float(), k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("htc,chd->thd", torch.softmax(scores, dim=-1), v)


def _ops_run(fn) -> set[str]:
    with torch.profiler.profile() as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "tokens,prefix,heads,kv_heads,dim,v_dim",
    [
        (33, 0, 9, 3, 64, 64),  # causal, GQA (SmolLM2's heads)
        (17, 40, 4, 4, 32, 32),  # a chunk over a cached prefix: mask
        (16, 48, 9, 3, 64, 64),  # the same with GQA: query heads folded into rows
        (5, 30, 8, 1, 32, 32),  # MQA
        (20, 0, 4, 4, 48, 32),  # MLA: keys wider than values
        (9, 25, 4, 4, 48, 32),
    ],
)
def test_equals_the_dense_reference_and_runs_the_flash_kernel(dtype, atol, tokens, prefix, heads, kv_heads, dim, v_dim):
    gen = torch.Generator().manual_seed(tokens + prefix)
    context = prefix + tokens
    query = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    keys = torch.randn(context, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(context, kv_heads, v_dim, generator=gen).to(dtype)
    mask = torch.ones(tokens, context, dtype=torch.bool).tril(diagonal=prefix)  # token j sees prefix + j + 1
    scale = dim**-0.5
    if prefix:
        run = lambda: attend_tokens_first(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)  # noqa: E731
    else:
        run = lambda: attend_tokens_first(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)  # noqa: E731
    out = run()
    assert out.shape == (tokens, heads, v_dim) and out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(query, keys, values, mask, scale), atol=atol, rtol=0)
    ops = _ops_run(run)
    assert FLASH_CPU in ops and MATH not in ops, sorted(op for op in ops if "scaled_dot" in op)
