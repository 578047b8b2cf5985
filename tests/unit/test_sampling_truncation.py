"""The fused truncation threshold (kernels/csrc/sampling_truncation.cpp) against a float64 sort of each row.

A row keeps the columns at or above its threshold: top-k's k-th value (ties included), top-p's cut over the
renormalized top-k set, min-p's ``max + log(min_p)``, whichever is highest. The reference sorts the whole row;
the kernel sorts only a window below the row's max, so rows here put the answer at every window's edge, beyond
the widest, and among ties (bf16-rounded logits).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_sampling import SMALL_LOGITS, assert_frequencies
from tests.unit.test_sampling_noise import kernel_ops
from worker_svc.sampling import Sampler, SamplingBatch, SamplingParams, noise_key

NEG_INF = float("-inf")


def reference_threshold(x: torch.Tensor, k: int, p: float, log_min_p: float) -> tuple[float, float]:
    """(threshold, distance of the top-p crossing's cumulative probability from top_p) for one row."""
    v = x.double()
    V = v.numel()
    ordered = v.sort(descending=True).values
    m = float(ordered[0])
    kth = float(ordered[k - 1]) if 0 < k < V else NEG_INF
    min_p_floor = float(torch.tensor(m, dtype=torch.float32) + torch.tensor(log_min_p, dtype=torch.float32))
    threshold, margin = max(kth, min_p_floor), math.inf  # the sum in float32, as both sampler paths take it
    if p < 1:
        kept = ordered[ordered >= kth]
        cum = (kept.float() - m).double().exp().cumsum(0)
        cum = cum / cum[-1]
        last = min(int((cum < p).sum()), kept.numel() - 1)
        threshold = max(threshold, float(kept[last]))
        margin = float((cum - p).abs().min())
    return threshold, margin


def _check(x: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> None:
    ops = kernel_ops()
    R, V = x.shape
    log_min_p = [math.log(q) if q > 0 else NEG_INF for q in min_p]
    got = ops.truncation_threshold(x, torch.ones(R), torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float32),
                                   torch.tensor(log_min_p, dtype=torch.float32), V)
    for r in range(R):
        want, margin = reference_threshold(x[r], top_k[r], top_p[r], log_min_p[r])
        if margin < 1e-5:
            continue  # the cut sits within float rounding of top_p: either neighbour is right
        assert float(got[r]) == pytest.approx(want, rel=0, abs=0 if math.isinf(want) else 1e-6), (r, top_k[r], top_p[r])


@pytest.mark.parametrize("V", [7, 1000, 49152])
@pytest.mark.parametrize("scale", [0.5, 3.0, 30.0])
def test_thresholds_match_a_full_sort(V: int, scale: float) -> None:
    g = torch.Generator().manual_seed(V + int(scale * 10))
    rows = [(0, 1.0, 0.0), (1, 1.0, 0.0), (5, 1.0, 0.0), (V - 1, 1.0, 0.0), (V, 1.0, 0.0), (0, 0.5, 0.0),
            (0, 0.9, 0.0), (0, 0.999, 0.0), (3, 0.9, 0.0), (50, 0.95, 0.0), (0, 1.0, 0.05), (20, 0.8, 0.1),
            (0, 0.01, 0.0), (1000, 0.9, 0.0), (600, 0.999, 0.01)]
    x = torch.randn(len(rows), V, generator=g) * scale
    top_k, top_p, min_p = (list(c) for c in zip(*rows, strict=True))
    _check(x, top_k, top_p, min_p)


def test_ties_and_bf16_logits() -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 5000, generator=g) * 4).to(torch.bfloat16).float()  # many equal values near the top
    x[4] = 2.5  # a flat row: every column ties
    x[5, :4990] = NEG_INF  # ten live columns
    _check(x, [40, 0, 40, 1, 7, 3], [1.0, 0.9, 0.9, 0.5, 0.3, 0.95], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    _check(x, [0, 0, 0, 0, 4999, 12], [0.999, 0.2, 0.7, 1.0, 1.0, 0.5], [0.0, 0.02, 0.0, 0.5, 0.0, 0.0])


def test_a_nucleus_past_the_widest_window() -> None:
    """Most of the mass far below the max (more than 32 nats): the kernel gathers every column."""
    V = 3000
    x = torch.full((1, V), -40.0)
    x[0, 0] = 0.0
    x[0, 1:2000] = torch.linspace(-35.0, -45.0, 1999)
    _check(x, [0], [0.9], [0.0])


def test_rows_read_through_a_stride_and_bad_arguments_are_refused() -> None:
    ops = kernel_ops()
    x = torch.randn(3, 100)
    wide = torch.cat([x, x], dim=1)
    args = (torch.ones(3), torch.tensor([5, 0, 0]), torch.tensor([1.0, 0.9, 1.0]), torch.full((3,), NEG_INF))
    assert torch.equal(ops.truncation_threshold(wide, *args, 100), ops.truncation_threshold(x, *args, 100))
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.truncation_threshold(x.to(torch.int32), *args, 100)
    with pytest.raises(RuntimeError, match="top_k"):
        ops.truncation_threshold(x, args[0], torch.tensor([5, 0]), *args[2:], 100)
    with pytest.raises(RuntimeError, match="inv_temperature"):
        ops.truncation_threshold(x, torch.ones(2), *args[1:], 100)
    with pytest.raises(RuntimeError, match="V must"):
        ops.truncation_threshold(x, *args, 101)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_half_precision_logits_are_scaled_as_the_tensor_path_scales_them(dtype: torch.dtype) -> None:
    """x * inv_temperature widened to float32 first (``x.float() * (1 / T)``), whatever x's dtype; rows with
    nothing to truncate get -inf without being read."""
    ops = kernel_ops()
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 3001, generator=g) * 4).to(dtype)
    inv_t = torch.tensor([1 / 0.7, 1.0, 1 / 1.3, 2.0, 1 / 0.7])
    args = (torch.tensor([40, 0, 7, 0, 0]), torch.tensor([0.9, 0.8, 1.0, 1.0, 1.0]),
            torch.tensor([NEG_INF, NEG_INF, NEG_INF, math.log(0.1), NEG_INF]))
    processed = x.float() * inv_t.view(5, 1)
    want = ops.truncation_threshold(processed, torch.ones(5), *args, 3001)
    assert torch.equal(ops.truncation_threshold(x, inv_t, *args, 3001), want)
    assert want[4] == NEG_INF


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        (SamplingParams(temperature=1.0, top_k=3), 3),
        (SamplingParams(temperature=1.0, top_p=0.55), 2),
        (SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05), None),
    ],
)
def test_fused_truncation_samples_the_truncated_distribution(params: SamplingParams, keep: int | None) -> None:
    ops = kernel_ops()
    n, V = 20_000, SMALL_LOGITS.numel()
    keys = [noise_key(9_000_011 + i) for i in range(n)]
    batch = SamplingBatch.build([params] * n, keys, [[]] * n, [[]] * n, frozenset(), V, "cpu")
    ids = Sampler(fused_ops=ops).sample(SMALL_LOGITS.expand(n, V), batch).next_token_ids
    probs = torch.softmax(SMALL_LOGITS.double() / params.temperature, dim=0)
    threshold, _ = reference_threshold(SMALL_LOGITS / params.temperature, params.top_k if params.top_k > 0 else 0,
                                       params.top_p, math.log(params.min_p) if params.min_p > 0 else NEG_INF)
    kept = (SMALL_LOGITS / params.temperature) >= threshold
    if keep is not None:
        assert int(kept.sum()) == keep
    expected = torch.where(kept, probs, torch.zeros_like(probs))
    assert_frequencies(torch.bincount(ids, minlength=V), expected / expected.sum())


def test_rows_of_nan_or_minus_infinity_do_not_break_the_kernel() -> None:
    """A model that produced NaN logits is a bug upstream; the threshold must still return, not read past a
    buffer (it leaves such rows untruncated)."""
    ops = kernel_ops()
    x = torch.randn(4, 300)
    x[0] = float("nan")
    x[1, ::2] = float("nan")
    x[2] = NEG_INF
    got = ops.truncation_threshold(x, torch.ones(4), torch.tensor([5, 200, 5, 0]), torch.tensor([0.9, 0.9, 0.9, 0.9]),
                                   torch.full((4,), NEG_INF), 300)
    assert got.shape == (4,)
    _check(x[3:], [0], [0.9], [0.0])
