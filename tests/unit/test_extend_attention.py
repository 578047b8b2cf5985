"""This project's extend attention (kernels/csrc/extend_attention_avx512.cpp), on AVX512-BF16 and on AMX tiles:
one request's new tokens over its cached prefix and themselves, causal. Held against a dense fp32 reference on
the same bf16 inputs, within what SDPA's flash kernel (the path it replaces) misses that reference by, across
the shapes the kernel tiles differently: tokens and prefixes off the 4-row / 16-row / 32-row / 64-key blocks,
GQA and MQA, MLA's wider keys, head sizes 32 to 192, the context read from a pool by slot or from strided
views, scores whose max keeps moving; and a step's requests in one call (the batched form) as each alone. The
AMX path runs where the CPU has AMX-BF16 and is reported skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_svc.attention.torch_native import TorchNativeAttentionBackend
from worker_svc.kernels import cpu_ext

AVX512_BF16, AMX = 1, 2  # the kernel's impl argument


def _ops(impl=AVX512_BF16):
    ops = cpu_ext.load()
    if ops is None or not ops.extend_attention_available():
        pytest.skip("this CPU lacks AVX512-BF16 (or the C++ kernels did not build): the extend kernel cannot run")
    if impl == AMX and not ops.extend_attention_amx_available():
        pytest.skip("this CPU (or its OS) does not grant AMX-BF16: the AMX extend attention cannot run")
    return ops


def _reference(query, keys, values, prefix, scale):
    """Dense fp32 attention: query [t, h, d], keys/values [c, kv_h, *] -> [t, h, v_dim], token j sees prefix + j + 1."""
    groups = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(groups, dim=1)
    v = values.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,chd->htc", query.float(), k) * scale
    mask = torch.ones(query.shape[0], keys.shape[0], dtype=torch.bool).tril(diagonal=prefix)
    return torch.einsum("htc,chd->thd", torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v), mask


def _sdpa(query, keys, values, mask, scale):
    v_dim = values.shape[-1]
    values = F.pad(values, (0, query.shape[-1] - v_dim))
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0, ..., :v_dim].transpose(0, 1)


@pytest.mark.parametrize(
    "tokens,prefix,heads,kv_heads,dim,v_dim",
    [
        (1, 0, 2, 1, 64, 64),  # one token, one key
        (33, 0, 9, 3, 64, 64),  # SmolLM2's heads, rows off the 4-row tiles
        (130, 70, 9, 3, 64, 64),  # several 32-row tasks and 64-key blocks, the prefix mid-block
        (64, 512, 9, 3, 64, 64),  # a cached prefix's chunk
        (17, 40, 4, 4, 32, 32),
        (5, 30, 8, 1, 32, 32),  # MQA
        (70, 100, 4, 1, 64, 64),  # MQA over several query blocks: fewer kv heads than threads, units split
        (100, 3, 2, 2, 128, 128),
        (20, 0, 4, 4, 48, 32),  # keys wider than values, values a multiple of 32 (not of 64)
        (9, 25, 4, 4, 192, 128),  # DeepSeek-V2's MLA head sizes
    ],
)
@pytest.mark.parametrize("impl", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx_bf16"])
def test_equals_the_fp32_reference_as_closely_as_sdpa(impl, tokens, prefix, heads, kv_heads, dim, v_dim):
    ops = _ops(impl)
    if impl == AMX and dim % 32:
        pytest.skip("AMX tiles take key heads in multiples of 32: this shape runs on AVX512-BF16 (refusal tested)")
    gen = torch.Generator().manual_seed(7 * tokens + prefix)
    context = prefix + tokens
    query = torch.randn(tokens, heads, dim, generator=gen).bfloat16()
    keys = torch.randn(context, kv_heads, dim, generator=gen).bfloat16()
    values = torch.randn(context, kv_heads, v_dim, generator=gen).bfloat16()
    scale = dim**-0.5
    expected, mask = _reference(query, keys, values, prefix, scale)
    out = ops.extend_attention(query, keys, values, None, prefix, scale, impl=impl)
    assert out.shape == (tokens, heads, v_dim) and out.dtype == torch.bfloat16
    sdpa_error = (_sdpa(query, keys, values, mask, scale).float() - expected).abs().max().item()
    error = (out.float() - expected).abs().max().item()
    assert error <= 1.25 * sdpa_error + 2e-3, (error, sdpa_error)

    # The same context scattered over a pool and read by slot; the answer must not change by a bit.
    pool_rows = 3 * context + 5
    k_pool = torch.randn(pool_rows, kv_heads, dim, generator=gen).bfloat16()
    v_pool = torch.randn(pool_rows, kv_heads, v_dim, generator=gen).bfloat16()
    slots = torch.randperm(pool_rows, generator=gen)[:context]
    k_pool[slots], v_pool[slots] = keys, values
    assert torch.equal(ops.extend_attention(query, k_pool, v_pool, slots, prefix, scale, impl=impl), out)


@pytest.mark.parametrize("slope", [0.05, 0.5, 4.0])
@pytest.mark.parametrize("v_dim", [64, 128])
@pytest.mark.parametrize("impl", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx_bf16"])
def test_scores_that_keep_rising_along_the_context(impl, v_dim, slope):
    """Scores that grow with the key's position by `slope` a key (natural-log units): the running max moves in
    every block, by less than the AMX path's lazy slack (0.05: ~2 log2 units a 32-key half), by more (0.5) and
    by far more (4.0), so its value tiles (v_dim 64) are flushed and rescaled often, never, or every half."""
    ops = _ops(impl)
    tokens, prefix, heads, kv_heads, dim = 40, 300, 4, 2, v_dim
    gen = torch.Generator().manual_seed(11)
    context = prefix + tokens
    query = torch.randn(tokens, heads, dim, generator=gen).bfloat16()
    keys = torch.randn(context, kv_heads, dim, generator=gen)
    query[:, :, 0] = 1.0
    keys[:, :, 0] = torch.arange(context, dtype=torch.float32)[:, None] * slope * dim**0.5  # score += slope * position
    keys = keys.bfloat16()
    values = torch.randn(context, kv_heads, v_dim, generator=gen).bfloat16()
    scale = dim**-0.5
    expected, mask = _reference(query, keys, values, prefix, scale)
    out = ops.extend_attention(query, keys, values, None, prefix, scale, impl=impl)
    sdpa_error = (_sdpa(query, keys, values, mask, scale).float() - expected).abs().max().item()
    error = (out.float() - expected).abs().max().item()
    assert error <= 1.25 * sdpa_error + 2e-3, (error, sdpa_error)


@pytest.mark.parametrize("impl", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx_bf16"])
def test_reads_strided_views_as_the_model_hands_them_over(impl):
    """q, k, v narrowed out of one qkv row ([tokens, q + 2 kv] wide), values with a head stride of their own."""
    ops = _ops(impl)
    tokens, heads, kv_heads, dim = 45, 9, 3, 64
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).bfloat16()
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    kv_wide = torch.randn(tokens, kv_heads, 2 * dim, generator=gen).bfloat16()
    v = kv_wide[..., dim:]  # head stride 2 dim
    scale = dim**-0.5
    out = ops.extend_attention(q, k, v, None, 0, scale, impl=impl)
    assert torch.equal(out, ops.extend_attention(q.contiguous(), k.contiguous(), v.contiguous(), None, 0, scale,
                                                 impl=impl))
    expected, _ = _reference(q, k, v, 0, scale)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)


@pytest.mark.parametrize("impl", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx_bf16"])
def test_a_steps_requests_in_one_call_equal_one_call_each(impl):
    """The batched form (one call a layer for a step's extends): requests with no prefix, a prefix mid-block and a
    long one, one to 64 new tokens, their new K/V read from the step's k / v and their prefixes from the pool; each
    request's rows bit for bit as the one-request call gives them, and rows of no request (a mixed step's decode
    rows) left as they were."""
    ops = _ops(impl)
    heads, kv_heads, dim = 9, 3, 64
    gen = torch.Generator().manual_seed(5)
    requests = [(0, 20), (70, 1), (512, 64), (3, 33), (130, 17)]  # (prefix, new tokens)
    gap = 2  # unrelated rows between requests
    q_starts, start = [], 0
    for _, tokens in requests:
        q_starts.append(start)
        start += tokens + gap
    rows = start
    q = torch.randn(rows, heads, dim, generator=gen).bfloat16()
    k = torch.randn(rows, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(rows, kv_heads, dim, generator=gen).bfloat16()
    pool_rows = 2000
    k_pool = torch.randn(pool_rows, kv_heads, dim, generator=gen).bfloat16()
    v_pool = torch.randn(pool_rows, kv_heads, dim, generator=gen).bfloat16()
    free = torch.randperm(pool_rows, generator=gen)
    prefix_slots, expected, used = [], [], 0
    for (prefix, tokens), q0 in zip(requests, q_starts, strict=True):
        cached = free[used : used + prefix]
        new = free[used + prefix : used + prefix + tokens]
        used += prefix + tokens
        k_pool[new], v_pool[new] = k[q0 : q0 + tokens], v[q0 : q0 + tokens]  # as the backend stores them first
        prefix_slots.append(cached)
        expected.append(ops.extend_attention(q[q0 : q0 + tokens], k_pool, v_pool, torch.cat((cached, new)), prefix,
                                             0.125, impl=impl))
    out = torch.full((rows, heads, dim), 7.0).bfloat16()
    ops.extend_attention_batch(q, k, v, k_pool, v_pool, torch.cat(prefix_slots), q_starts,
                               [t for _, t in requests], [p for p, _ in requests], 0.125, impl, out)
    for (_, tokens), q0, want in zip(requests, q_starts, expected, strict=True):
        assert torch.equal(out[q0 : q0 + tokens], want)
        assert (out[q0 + tokens : q0 + tokens + gap] == 7.0).all()


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: {**a, "prefix_slots": a["prefix_slots"][:-1]}, "fewer than the prefixes"),
        (lambda a: {**a, "prefix_slots": torch.cat((a["prefix_slots"], a["prefix_slots"]))}, "slots, the prefixes"),
        (lambda a: {**a, "prefix_slots": a["prefix_slots"].clone().fill_(10_000)}, "out of range"),
        (lambda a: {**a, "q_starts": [0, 7]}, "outside the 8 query rows"),
        (lambda a: {**a, "extend_lens": [4]}, "one entry per request"),
        (lambda a: {**a, "out": a["out"][:, :4]}, "out must be a contiguous bfloat16"),
        (lambda a: {**a, "v": a["v"][:4]}, "must match q"),
    ],
)
def test_the_batched_form_refuses_bad_arguments_with_the_reason(change, message):
    ops = _ops()
    args = {"q": torch.zeros(8, 9, 64).bfloat16(), "k": torch.zeros(8, 3, 64).bfloat16(),
            "v": torch.zeros(8, 3, 64).bfloat16(), "k_pool": torch.zeros(16, 3, 64).bfloat16(),
            "v_pool": torch.zeros(16, 3, 64).bfloat16(), "prefix_slots": torch.arange(5), "q_starts": [0, 4],
            "extend_lens": [4, 4], "prefix_lens": [2, 3], "scale": 0.125, "impl": 0,
            "out": torch.zeros(8, 9, 64).bfloat16()}
    with pytest.raises(RuntimeError, match=message):
        ops.extend_attention_batch(**change(args))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda q, k, v, s: (q.float(), k, v, s, 0), "q must be a bfloat16"),
        (lambda q, k, v, s: (q, k, v[:, :1], s, 0), "values must have 3 heads"),
        (lambda q, k, v, s: (q[:, :4], k, v, s, 0), "must be a multiple of kv heads"),
        (lambda q, k, v, s: (q, k, v[..., :16], s, 0), "values a multiple of 32"),
        (lambda q, k, v, s: (q, k, v, s[:-1], 0), "slots must be int64"),
        (lambda q, k, v, s: (q, k, v, s.clone().fill_(10_000), 0), "out of range"),
        (lambda q, k, v, s: (q, k, v, None, 1), "need prefix \\+ tokens"),
        (lambda q, k, v, s: (q, k, v, None, -1), "prefix must be >= 0"),
    ],
)
def test_bad_arguments_are_refused_with_the_reason(change, message):
    ops = _ops()
    q, k, v = torch.zeros(8, 9, 64).bfloat16(), torch.zeros(8, 3, 64).bfloat16(), torch.zeros(8, 3, 64).bfloat16()
    with pytest.raises(RuntimeError, match=message):
        ops.extend_attention(*change(q, k, v, torch.arange(8)), 0.125)


def test_auto_takes_amx_where_it_fits_and_amx_refuses_what_it_cannot_run():
    ops = _ops()
    q, k, v = torch.randn(20, 4, 48).bfloat16(), torch.randn(20, 4, 48).bfloat16(), torch.randn(20, 4, 32).bfloat16()
    # Key heads of 48: never the AMX path; auto runs AVX512-BF16, bit for bit.
    assert torch.equal(ops.extend_attention(q, k, v, None, 0, 0.1), ops.extend_attention(q, k, v, None, 0, 0.1, impl=1))
    with pytest.raises(RuntimeError, match="AMX path needs AMX-BF16 and key heads a multiple of 32"):
        ops.extend_attention(q, k, v, None, 0, 0.1, impl=AMX)
    with pytest.raises(RuntimeError, match="impl must be 0"):
        ops.extend_attention(q, k, v, None, 0, 0.1, impl=3)
    q, k, v = torch.randn(20, 4, 64).bfloat16(), torch.randn(20, 4, 64).bfloat16(), torch.randn(20, 4, 64).bfloat16()
    best = AMX if ops.extend_attention_amx_available() else AVX512_BF16
    assert ops.extend_attention_auto_impl(64, 64) == best
    auto = ops.extend_attention(q, k, v, None, 0, 0.1)
    assert torch.equal(auto, ops.extend_attention(q, k, v, None, 0, 0.1, impl=best))


def test_the_backend_takes_the_kernel_only_where_it_was_chosen():
    ops = cpu_ext.load()
    assert TorchNativeAttentionBackend("grouped_matmul", ops)._extend_kernel is None  # sdpa by default
    with pytest.raises(ValueError, match="needs the CPU kernels"):
        TorchNativeAttentionBackend("grouped_matmul", None, extend_impl="avx512_bf16")
    with pytest.raises(ValueError, match="extend_impl must be one of"):
        TorchNativeAttentionBackend("grouped_matmul", ops, extend_impl="flash")
