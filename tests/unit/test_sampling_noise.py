"""Sampling noise (worker_svc/sampling/noise.py) and its fused CPU race (kernels/csrc/sampling_race.cpp).

Philox4x32-10 is held to Random123's published known answers; the token layout to its two addressings (every
token of a row, chosen tokens only); the C++ noise and race, on each ISA the host runs, to the tensor-op
definition; and the sampler with the fused race to the one without, token for token and by frequencies.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_sampling import (
    SMALL_LOGITS,
    assert_frequencies,
    random_steps,
)
from worker_svc.kernels import cpu_ext
from worker_svc.sampling import Sampler, SamplingBatch, SamplingParams, noise, noise_key

AVX2, AVX512 = 1, 2  # the kernels' isa argument


def kernel_ops(isa: int = AVX2):
    """This project's C++ kernels, or a skip where they (or the ISA asked for) cannot run here."""
    ops = cpu_ext.load()
    if ops is None:
        pytest.skip("this project's C++ kernels cannot run here (not x86-64 with AVX2, or no compiler)")
    if isa == AVX512 and not ops.quant_avx512_available():
        pytest.skip("this CPU lacks AVX-512 F/BW/VL/DQ: the AVX-512 race cannot run")
    return ops


def _words(counter: tuple[int, ...], key: tuple[int, ...]) -> tuple[int, ...]:
    ctr = tuple(torch.tensor([c]) for c in counter)
    k = (torch.tensor([key[0]]), torch.tensor([key[1]]))
    return tuple(int(w) for w in noise.philox4x32_10(ctr, k))  # type: ignore[arg-type]


def test_philox_matches_random123_known_answers() -> None:
    assert _words((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert _words((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert _words((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


KEYS = torch.tensor(noise.as_int64([0, 1, (1 << 64) - 1, 12345678901234567, 1 << 63]))
STEPS = torch.tensor([0, 1, 7, (1 << 32) + 5, 99])


def test_token_layout_and_the_uniform_grid() -> None:
    V = 1000
    u = noise.uniforms(KEYS, STEPS, V)
    tokens = torch.randint(0, V, (5, 33), generator=torch.Generator().manual_seed(0))
    assert torch.equal(noise.uniforms_at(KEYS, STEPS, tokens), u.gather(1, tokens))
    # Token 64 b + 16 k + lane is word k of the block counted 16 b + lane.
    w = _words((16 * 3 + 5, 1, 0, 0), (1, 0))  # row 1: key 1, step 1
    assert u[1, 64 * 3 + 16 * 2 + 5] == ((w[2] >> 9) * 2 + 1) * 2.0**-24
    odd = u * 2**24
    assert bool(((odd > 0) & (odd < 2**24)).all()) and bool((odd.remainder(2) == 1).all())
    # Steps (and keys) give fresh noise: a prefix of V is the same noise.
    assert torch.equal(noise.uniforms(KEYS, STEPS, 70), u[:, :70])
    assert not torch.equal(noise.uniforms(KEYS, STEPS + 1, V), u)


def test_uniforms_are_uniform() -> None:
    u = noise.uniforms(torch.arange(64), torch.zeros(64, dtype=torch.long), 16384).flatten()  # 1M draws
    counts = torch.histc(u, bins=32, min=0.0, max=1.0)
    expected = u.numel() / 32
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 80, chi2  # 31 degrees of freedom: p ~ 3e-6
    assert abs(float(u.mean()) - 0.5) < 6 * (1 / 12 / u.numel()) ** 0.5


@pytest.mark.parametrize("isa", [AVX2, AVX512])
@pytest.mark.parametrize("V", [1, 8, 63, 64, 65, 1000, 49159])
def test_kernel_noise_equals_the_definition(isa: int, V: int) -> None:
    ops = kernel_ops(isa)
    reference = noise.gumbel(noise.uniforms(KEYS, STEPS, V))
    torch.testing.assert_close(ops.gumbel_noise(KEYS, STEPS, V, isa), reference, rtol=2e-7, atol=6e-7)


def _race_inputs(R: int, V: int, width: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, width, generator=g) * 3).to(dtype)
    keys = torch.randint(-(2**62), 2**62, (R,), generator=g)
    steps = torch.randint(0, 1 << 40, (R,), generator=g)
    inv_t = 1.0 / (0.2 + 2 * torch.rand(R, generator=g))
    return x, keys, steps, inv_t


@pytest.mark.parametrize("isa", [AVX2, AVX512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("V", [5, 200, 20_000])
def test_kernel_race_equals_the_definition(isa: int, dtype: torch.dtype, V: int) -> None:
    ops = kernel_ops(isa)
    R = 24
    x, keys, steps, inv_t = _race_inputs(R, V, V + 13, dtype, seed=V)  # a padded row: V of V + 13 columns
    s = x[:, :V].float() * inv_t.view(R, 1)
    # Half the rows truncated (a threshold per row), half not.
    floor = s.topk(min(V, 4), dim=-1).values[:, -1].clone()
    floor[::2] = float("-inf")
    got = ops.gumbel_race(x, inv_t, floor, keys, steps, V, isa)
    want = noise.gumbel_race(s, floor.view(R, 1), keys, steps)
    assert bool((s.gather(1, got.view(R, 1)).view(R) >= floor).all())
    scores = s + noise.gumbel(noise.uniforms(keys, steps, V))
    scores[s < floor.view(R, 1)] = float("-inf")
    differ = got != want
    # Only where the two best scores tie to float32's last places (kernel log vs torch's) may they differ.
    gap = (scores.gather(1, want.view(R, 1)) - scores.gather(1, got.view(R, 1))).view(R)
    assert bool((gap[differ].abs() < 1e-5).all()), gap[differ]
    assert int(differ.sum()) <= 1


@pytest.mark.parametrize("isa", [AVX2, AVX512])
def test_kernel_race_edges(isa: int) -> None:
    ops = kernel_ops(isa)
    V = 300
    x, keys, steps, _ = _race_inputs(3, V, V, torch.float32, seed=1)
    ones = torch.ones(3)
    # Everything cut: token 0, as argmax over all -inf gives.
    none_kept = ops.gumbel_race(x, ones, torch.full((3,), float("inf")), keys, steps, V, isa)
    assert none_kept.tolist() == [0, 0, 0]
    # A threshold at each row's max keeps only its argmax, whatever the noise.
    top = ops.gumbel_race(x, ones, x.amax(dim=-1), keys, steps, V, isa)
    assert torch.equal(top, x.argmax(dim=-1))
    # -inf logits (masked tokens) never win.
    masked = x.clone()
    masked[:, 1:] = float("-inf")
    assert ops.gumbel_race(masked, ones, torch.full((3,), float("-inf")), keys, steps, V, isa).tolist() == [0, 0, 0]
    # A strided row view reads its own row.
    wide = torch.cat([x, x], dim=1)[:, :V]
    assert torch.equal(ops.gumbel_race(wide, ones, torch.full((3,), float("-inf")), keys, steps, V, isa),
                       ops.gumbel_race(x.contiguous(), ones, torch.full((3,), float("-inf")), keys, steps, V, isa))
    with pytest.raises(RuntimeError, match="keys and steps"):
        ops.gumbel_race(x, ones, ones, keys[:2], steps, V, isa)


MIXED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, top_k=40),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=1.1, repetition_penalty=1.2),
]


@pytest.mark.parametrize("isa", [AVX2, AVX512])
def test_rows_not_sampled_race_without_noise(isa: int) -> None:
    """sampled=False: the row's argmax of x * inv_temperature over the kept columns, first occurrence on ties."""
    ops = kernel_ops(isa)
    V = 5000
    x = (torch.randn(4, V, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    x[3, 17] = x[3, 4000] = 50.0  # a tie at the top: the first wins
    inv_t, floor = torch.tensor([1.0, 1.0, 2.0, 1.0]), torch.full((4,), float("-inf"))
    keys, steps = torch.arange(4), torch.zeros(4, dtype=torch.long)
    sampled = torch.tensor([False, True, False, False])
    got = ops.gumbel_race(x, inv_t, floor, keys, steps, V, isa, sampled)
    want = x.float().argmax(dim=-1)
    assert got[0] == want[0] and got[2] == want[2] and got[3] == 17
    assert got[1] == ops.gumbel_race(x[1:2], inv_t[1:2], floor[1:2], keys[1:2], steps[1:2], V, isa)[0]
    with pytest.raises(RuntimeError, match="sampled must be bool"):
        ops.gumbel_race(x, inv_t, floor, keys, steps, V, isa, sampled[:3])


@pytest.mark.parametrize("rows", [MIXED, MIXED[:-1], [SamplingParams(temperature=0.6)] * 6])
def test_sampler_with_the_fused_race_equals_the_tensor_ops(rows: list[SamplingParams]) -> None:
    ops = kernel_ops(AVX2)
    B, V = len(rows), 4000
    steps = random_steps(12, B, V, seed=5, bf16=True)
    outputs: list[list[int]] = [[] for _ in rows]
    keys = [noise_key(100 + i) for i in range(B)]
    for x in steps:
        batch = SamplingBatch.build(rows, keys, outputs, [[1, 2]] * B, frozenset(), V, "cpu")
        # Without the penalty row the fused sampler reads the raw logits (greedy rows race without noise).
        assert batch.unprocessed == all(p.repetition_penalty == 1.0 for p in rows)
        fused = Sampler(fused_ops=ops).sample(x.to(torch.bfloat16), batch).next_token_ids
        plain = Sampler().sample(x.to(torch.bfloat16), batch).next_token_ids
        assert torch.equal(fused, plain)
        for row, token in enumerate(fused.tolist()):
            outputs[row].append(token)
    assert len({tuple(o) for o in outputs}) == B  # every row drew its own tokens


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_fused_race_frequencies(temperature: float) -> None:
    ops = kernel_ops(AVX2)
    n, V = 20_000, 8
    keys = [noise_key(7_000_003 + i) for i in range(n)]
    batch = SamplingBatch.build([SamplingParams(temperature=temperature)] * n, keys, [[]] * n, [[]] * n, frozenset(), V,
                                "cpu")
    assert batch.unprocessed
    ids = Sampler(fused_ops=ops).sample(SMALL_LOGITS.expand(n, V), batch).next_token_ids
    expected = torch.softmax(SMALL_LOGITS.double() / temperature, dim=0)
    assert_frequencies(torch.bincount(ids, minlength=V), expected)


def test_scheduler_samples_with_the_fused_race_where_the_kernels_load(tiny_model) -> None:
    from worker_svc.config.engine_config import EngineConfig
    from worker_svc.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=str(tiny_model), dtype="float32", max_total_tokens=256,
                                 context_length=128))
    assert (engine.scheduler.sampler.fused_ops is not None) == (cpu_ext.load() is not None)
    a = engine.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=42, max_new_tokens=8))
    b = engine.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=42, max_new_tokens=8))
    assert a[0].output_ids == b[0].output_ids and len(a[0].output_ids) == 8
