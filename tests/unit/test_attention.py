"""Torch-native attention backend: the grouped-matmul decode, SDPA decode and the AVX2 kernel equal a
dense reference, for GQA, MHA, ragged lengths (masking), scattered slots and three dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from worker_svc.attention.base import AttentionLayer, MLAAttentionLayer
from worker_svc.attention.torch_native import TorchNativeAttentionBackend
from worker_svc.attention.torch_native_mla import TorchNativeMLABackend
from worker_svc.forward_batch import ForwardBatch, ForwardMode
from worker_svc.kernels import cpu_ext
from worker_svc.kvcache import MHAKVPool, MLAKVPool

CPU_OPS = cpu_ext.load()
needs_cpu_ops = pytest.mark.skipif(CPU_OPS is None, reason="AVX2 kernels unavailable on this host")


def _decode_batch(backend, dtype, seq_lens, heads=8, kv_heads=2, dim=16):
    gen = torch.Generator().manual_seed(0)
    pool = MHAKVPool(256, 1, kv_heads, dim, dtype, torch.device("cpu"))
    table = torch.zeros(len(seq_lens), 65, dtype=torch.int64)
    order = torch.randperm(255, generator=gen) + 1  # scattered slots, as a long-running pool has them
    next_slot = 0
    for row, length in enumerate(seq_lens):
        slots = order[next_slot : next_slot + length]
        table[row, :length] = slots
        pool.k_buffers[0][slots] = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
        pool.v_buffers[0][slots] = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
        next_slot += length
    last = table[torch.arange(len(seq_lens)), torch.tensor(seq_lens) - 1]
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(seq_lens), dtype=torch.int64),
        positions=torch.tensor(seq_lens) - 1,
        out_slots=last,
        req_rows=torch.arange(len(seq_lens)),
        seq_lens=list(seq_lens),
        prefix_lens=[s - 1 for s in seq_lens],
        req_to_token=table,
        kv_pool=pool,
        attn_backend=backend,
    )
    backend.prepare(batch)
    layer = AttentionLayer(0, heads, kv_heads, dim, scaling=dim**-0.5)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen).to(dtype)
    # The step re-stores each request's newest K/V (as the model would): keep what is in the pool.
    k_new = pool.k_buffers[0][last].clone()
    v_new = pool.v_buffers[0][last].clone()
    return batch, layer, q, k_new, v_new, table


def _dense_reference(q, batch, table, layer):
    outs = []
    groups = layer.num_heads // layer.num_kv_heads
    for i, length in enumerate(batch.seq_lens):
        slots = table[i, :length]
        k = batch.kv_pool.k_buffers[0][slots].float().repeat_interleave(groups, dim=1)  # [len, heads, dim]
        v = batch.kv_pool.v_buffers[0][slots].float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) / math.sqrt(layer.head_dim)
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seq_lens", [[5, 5, 5], [1, 17, 64, 3]])
def test_decode_grouped_matmul_equals_sdpa_and_reference(dtype, atol, seq_lens):
    results = {}
    for impl in ("grouped_matmul", "sdpa"):
        backend = TorchNativeAttentionBackend(decode_impl=impl)
        batch, layer, q, k_new, v_new, table = _decode_batch(backend, dtype, seq_lens)
        results[impl] = backend.forward(q, k_new, v_new, layer, batch).float()
    ref = _dense_reference(q, batch, table, layer)
    assert torch.allclose(results["grouped_matmul"], ref, atol=atol)
    assert torch.allclose(results["sdpa"], ref, atol=atol)


@needs_cpu_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens", [[5, 5, 5], [1, 17, 64, 3], [40]])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 16), (4, 4, 64), (6, 1, 20)])
def test_decode_avx2_kernel_equals_grouped_matmul(dtype, seq_lens, heads, kv_heads, dim):
    """Same fp32 arithmetic, so within summation-order noise of the torch path, for GQA, MHA, MQA and
    a head size that is not a multiple of the vector width."""
    results = {}
    for impl in ("grouped_matmul", "avx2"):
        backend = TorchNativeAttentionBackend(decode_impl=impl, cpu_ops=CPU_OPS)
        batch, layer, q, k_new, v_new, table = _decode_batch(backend, dtype, seq_lens, heads, kv_heads, dim)
        results[impl] = backend.forward(q, k_new, v_new, layer, batch)
    assert results["avx2"].dtype == dtype
    ref = _dense_reference(q, batch, table, layer)
    assert torch.allclose(results["avx2"].float(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2)
    if dtype == torch.float32:
        assert torch.allclose(results["avx2"], results["grouped_matmul"], atol=1e-6)
    else:  # both round the same fp32 result once to the activation dtype
        assert (results["avx2"].float() - results["grouped_matmul"].float()).abs().max().item() <= 1e-2


@needs_cpu_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 64), (16, 2, 128), (4, 4, 32), (24, 2, 32)])
def test_decode_avx512_path_equals_the_avx2_path_and_the_reference(dtype, heads, kv_heads, dim):
    """The AVX-512 path holds up to 16 / (dim / 16) query heads of a KV head in registers: GQA within one
    chunk, MQA and GQA over several chunks (24 heads of 32: 8 + 4; 16 of 128: 2 at a time), MHA."""
    if not CPU_OPS.decode_attention_avx512_available():
        pytest.skip("this CPU lacks AVX-512 F/BW/VL/DQ: the AVX-512 decode attention cannot run")
    backend = TorchNativeAttentionBackend(decode_impl="avx2", cpu_ops=CPU_OPS)
    batch, layer, q, k_new, v_new, table = _decode_batch(backend, dtype, [1, 17, 64, 3], heads, kv_heads, dim)
    backend.forward(q, k_new, v_new, layer, batch)  # stores the new K/V
    k_buf, v_buf = batch.kv_pool.buffers(0)
    meta = batch.attn_metadata
    args = (q.contiguous(), k_buf, v_buf, meta.slot_index, meta.seq_lens, layer.scaling)
    avx2, avx512 = CPU_OPS.decode_attention(*args, 1), CPU_OPS.decode_attention(*args, 2)
    ref = _dense_reference(q, batch, table, layer).view_as(avx512)
    assert avx512.dtype == dtype and (avx512.float() - ref).abs().max().item() <= 2e-2
    assert (avx512.float() - avx2.float()).abs().max().item() <= 1e-2  # one rounding of close fp32 sums
    best = avx512
    if dtype == torch.bfloat16 and CPU_OPS.decode_attention_avx512_bf16_available():
        best = CPU_OPS.decode_attention(*args, 3)  # VDPBF16PS scores, 4 keys reduced together
        assert best.dtype == dtype and (best.float() - ref).abs().max().item() <= 2e-2
        assert (best.float() - avx512.float()).abs().max().item() <= 1e-2
    assert torch.equal(CPU_OPS.decode_attention(*args), best)  # auto: the AVX512-BF16 path where it runs


def _isas_this_host_runs() -> list[int]:
    isas = [1]
    if CPU_OPS is not None and CPU_OPS.decode_attention_avx512_available():
        isas.append(2)
    if CPU_OPS is not None and CPU_OPS.decode_attention_avx512_bf16_available():
        isas.append(3)
    return isas


@needs_cpu_ops
@pytest.mark.parametrize("query_scale", [1.0, 40.0])
def test_decode_softmax_tails_and_peaked_scores_on_every_path(query_scale):
    """Lengths around the 8- and 16-lane softmax steps (empty body, exact multiples, tails), and queries
    scaled so that most probabilities underflow to 0 (scores tens to hundreds apart): each path this host
    runs equals an fp64 softmax(q.K) V. Paths the CPU lacks are left out (reported by the AVX-512 tests)."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 9, 3, 64
    lens = [1, 7, 8, 15, 16, 17, 31, 32, 47, 250]
    slots_total = sum(lens) + 8
    k_pool = torch.randn(slots_total, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v_pool = torch.randn(slots_total, kv_heads, dim, generator=gen).to(torch.bfloat16)
    q = (torch.randn(len(lens), heads, dim, generator=gen) * query_scale).to(torch.bfloat16)
    order = torch.randperm(slots_total, generator=gen)
    slot_index = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    start = 0
    for row, length in enumerate(lens):
        slot_index[row, :length] = order[start : start + length]
        start += length
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    scaling = dim**-0.5
    expected = torch.empty(len(lens), heads, dim, dtype=torch.float64)
    for row, length in enumerate(lens):
        keys = k_pool[slot_index[row, :length]].double().repeat_interleave(heads // kv_heads, dim=1)
        values = v_pool[slot_index[row, :length]].double().repeat_interleave(heads // kv_heads, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[row].double(), keys) * scaling).softmax(-1)
        expected[row] = torch.einsum("hl,lhd->hd", probs, values)
    for isa in _isas_this_host_runs():
        out = CPU_OPS.decode_attention(q, k_pool, v_pool, slot_index, seq_lens, scaling, isa)
        # bf16 output: one rounding (2^-8 relative) of values of magnitude up to ~3
        assert (out.double() - expected).abs().max().item() <= 2e-2, f"isa {isa}"


@needs_cpu_ops
def test_decode_avx512_bf16_path_refuses_what_it_cannot_run():
    if not CPU_OPS.decode_attention_avx512_bf16_available():
        pytest.skip("this CPU lacks AVX512-BF16: the VDPBF16PS decode attention cannot run")
    backend = TorchNativeAttentionBackend(decode_impl="avx2", cpu_ops=CPU_OPS)
    batch, layer, q, _, _, _ = _decode_batch(backend, torch.float16, [4, 6], 4, 2, 64)
    k_buf, v_buf = batch.kv_pool.buffers(0)
    args = (q.contiguous(), k_buf, v_buf, batch.attn_metadata.slot_index, batch.attn_metadata.seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="AVX512-BF16 path needs"):
        CPU_OPS.decode_attention(*args, 3)  # fp16 pools: the AVX-512 fp32 path only
    assert torch.equal(CPU_OPS.decode_attention(*args), CPU_OPS.decode_attention(*args, 2))


@needs_cpu_ops
def test_decode_avx512_path_refuses_what_it_cannot_run():
    backend = TorchNativeAttentionBackend(decode_impl="avx2", cpu_ops=CPU_OPS)
    for dtype, dim in ((torch.float32, 64), (torch.bfloat16, 20)):
        batch, layer, q, _, _, _ = _decode_batch(backend, dtype, [4, 6], 4, 2, dim)
        k_buf, v_buf = batch.kv_pool.buffers(0)
        args = (q.contiguous(), k_buf, v_buf, batch.attn_metadata.slot_index, batch.attn_metadata.seq_lens, 0.25)
        with pytest.raises(RuntimeError, match="AVX-512 paths need"):
            CPU_OPS.decode_attention(*args, 2)
        assert CPU_OPS.decode_attention(*args).shape == q.shape  # auto: the AVX2 code


@needs_cpu_ops
def test_decode_avx2_kernel_rejects_bad_lengths():
    backend = TorchNativeAttentionBackend(decode_impl="avx2", cpu_ops=CPU_OPS)
    batch, layer, q, _, _, _ = _decode_batch(backend, torch.float32, [4, 6])
    k_buf, v_buf = batch.kv_pool.buffers(0)
    with pytest.raises(RuntimeError, match="seq_lens"):
        CPU_OPS.decode_attention(q, k_buf, v_buf, batch.attn_metadata.slot_index, torch.tensor([4, 99]), 0.25)


def test_avx2_decode_needs_the_kernels():
    with pytest.raises(ValueError, match="cpu_ext"):
        TorchNativeAttentionBackend(decode_impl="avx2")


def test_unknown_decode_impl_is_rejected():
    with pytest.raises(ValueError, match="decode_impl"):
        TorchNativeAttentionBackend(decode_impl="flash")


def test_a_layer_refuses_the_other_kind_of_backend():
    """MLA has its own backend interface: an MHA layer given the MLA backend (or the MHA backend given
    the latent pool) fails naming what it needs, instead of running the wrong attention."""
    mla = TorchNativeMLABackend()
    batch, layer, q, k, v, _ = _decode_batch(mla, torch.float32, [3, 5])
    with pytest.raises(TypeError, match="MHA attention backend"):
        layer(q, k, v, batch)
    mha = TorchNativeAttentionBackend()
    batch.attn_backend = mha
    batch.kv_pool = MLAKVPool(8, 1, 4, 2, torch.float32, torch.device("cpu"))
    with pytest.raises(TypeError, match="MHAKVPool"):
        layer(q, k, v, batch)
    latent_layer = MLAAttentionLayer(0, 2, 4, 3, 2, 3, scaling=1.0, kv_b_proj=torch.nn.Linear(4, 2 * (3 + 3)))
    with pytest.raises(TypeError, match="MLA attention backend"):
        latent_layer(q[:, :2, :3], q[:, :2, :2], torch.zeros(2, 6), batch)


def _mixed_extend_batch(backend, dtype, heads=8, kv_heads=2, dim=16):
    """An extend step as a mixed step makes it: a fresh prompt of 6 tokens, a 4-token extend on a cached
    prefix of 9, and three requests adding one token to cached prefixes of 12, 3 and 30 (the decode rows).
    Every new token's K/V is in the pool already (the backend stores before attending)."""
    gen = torch.Generator().manual_seed(1)
    prefix_lens, seq_lens = [0, 9, 12, 3, 30], [6, 13, 13, 4, 31]
    pool = MHAKVPool(256, 1, kv_heads, dim, dtype, torch.device("cpu"))
    table = torch.zeros(len(seq_lens), 65, dtype=torch.int64)
    order = torch.randperm(255, generator=gen) + 1
    used = 0
    for row, length in enumerate(seq_lens):
        table[row, :length] = order[used : used + length]
        used += length
    slots = pool.k_buffers[0].shape[0] - 1  # slot 0 is the padding slot
    pool.k_buffers[0][1:] = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    pool.v_buffers[0][1:] = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    new_slots = torch.cat([table[i, p:s] for i, (p, s) in enumerate(zip(prefix_lens, seq_lens, strict=True))])
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros(len(new_slots), dtype=torch.int64),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens, strict=True)]),
        out_slots=new_slots, req_rows=torch.arange(len(seq_lens)), seq_lens=seq_lens, prefix_lens=prefix_lens,
        req_to_token=table, kv_pool=pool, attn_backend=backend,
    )
    layer = AttentionLayer(0, heads, kv_heads, dim, scaling=dim**-0.5)
    q = torch.randn(len(new_slots), heads, dim, generator=gen).to(dtype)
    return batch, layer, q, pool.k_buffers[0][new_slots].clone(), pool.v_buffers[0][new_slots].clone()


@pytest.mark.parametrize("impl", ["grouped_matmul", "sdpa", pytest.param("avx2", marks=needs_cpu_ops)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
def test_a_mixed_steps_one_token_rows_attend_as_one_decode(impl, dtype, atol):
    """The requests adding one token to a cached prefix (a mixed step's decode rows) go into one decode call
    (the backend's decode kernel) instead of one masked attention each: the same output as attending every
    request on its own, and as the backend's own decode of those rows."""
    from worker_svc.attention.metadata import prepare_extend

    backend = TorchNativeAttentionBackend(decode_impl=impl, cpu_ops=CPU_OPS)
    batch, layer, q, k, v = _mixed_extend_batch(backend, dtype)
    backend.prepare(batch)
    one = batch.attn_metadata.one_token
    assert one is not None and one.requests == [2, 3, 4] and one.tokens.tolist() == [10, 11, 12]
    assert one.decode.seq_lens.tolist() == [13, 4, 31] and one.decode.mask is not None
    grouped = backend.forward(q, k, v, layer, batch)
    batch.attn_metadata = prepare_extend(batch)  # every request on its own
    assert batch.attn_metadata.one_token is None
    per_request = backend.forward(q, k, v, layer, batch)
    torch.testing.assert_close(grouped.float(), per_request.float(), rtol=0, atol=atol)
    # Row by row (deterministic inference) nothing is grouped: each token attends as a decode of its own.
    row_wise = TorchNativeAttentionBackend(decode_impl=impl, cpu_ops=CPU_OPS, row_wise=True)
    batch.attn_backend = row_wise
    row_wise.prepare(batch)
    assert batch.attn_metadata.one_token is None


def test_extend_through_this_projects_kernel_equals_sdpa():
    """A mixed extend step (a fresh prompt, a chunk over a cached prefix, one-token rows) through the backend
    with this project's extend kernel, on VDPBF16PS and (where the CPU has AMX-BF16) on AMX tiles: each
    request's rows as SDPA gives them, within bf16 rounding."""
    if CPU_OPS is None or not CPU_OPS.extend_attention_available():
        pytest.skip("this CPU lacks AVX512-BF16 (or the C++ kernels did not build): the extend kernel cannot run")
    kernels = ["avx512_bf16"] + (["amx_bf16"] if CPU_OPS.extend_attention_amx_available() else [])
    outs, ops_run, contexts_built = {}, {}, {}
    for impl in ["sdpa", *kernels]:
        backend = TorchNativeAttentionBackend(decode_impl="avx2", cpu_ops=CPU_OPS, extend_impl=impl)
        batch, layer, q, k, v = _mixed_extend_batch(backend, torch.bfloat16, heads=9, kv_heads=3, dim=64)
        backend.prepare(batch)
        with torch.profiler.profile() as prof:
            outs[impl] = backend.forward(q, k, v, layer, batch).float()
        ops_run[impl] = {event.key for event in prof.key_averages()}
        contexts_built[impl] = "contexts" in batch.attn_metadata.__dict__
    for impl in kernels:
        torch.testing.assert_close(outs[impl], outs["sdpa"], rtol=0, atol=1.6e-2)
        # The fresh prompt and the chunk went through the kernel, in one call, and SDPA did not run.
        assert "llmserve_cpu::extend_attention_batch" in ops_run[impl]
        assert "llmserve_cpu::extend_attention" not in ops_run[impl]
        assert not any("scaled_dot_product" in op for op in ops_run[impl])
        # Nor were the per-request slots and masks only SDPA reads built (ExtendMetadata.contexts, on first use).
        assert not contexts_built[impl]
    assert not any(op.startswith("llmserve_cpu::extend_attention") for op in ops_run["sdpa"])
    assert contexts_built["sdpa"]


def test_the_per_request_contexts_the_sdpa_path_reads():
    """ExtendMetadata.contexts, built on first use: for a request over a cached prefix, all its slots and its
    new tokens' causal mask (token i sees the prefix and new tokens 0..i); nothing for a fresh prompt or the
    one-token rows (attended as one decode)."""
    backend = TorchNativeAttentionBackend(decode_impl="sdpa")
    batch, _, _, _, _ = _mixed_extend_batch(backend, torch.float32)
    backend.prepare(batch)
    contexts = batch.attn_metadata.contexts
    assert contexts.slots[0] is None and contexts.masks[0] is None  # the fresh prompt: plain causal
    assert all(contexts.slots[i] is None and contexts.masks[i] is None for i in (2, 3, 4))  # the one-token rows
    assert torch.equal(contexts.slots[1], batch.req_to_token[1, :13])
    expected = torch.ones(4, 13, dtype=torch.bool).tril(diagonal=9)  # prefix of 9, then causal over 4 new tokens
    assert torch.equal(contexts.masks[1], expected)
    assert batch.attn_metadata.contexts is contexts  # built once a step
