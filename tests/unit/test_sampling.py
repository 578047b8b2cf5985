"""Sampler and SamplingParams tests.

Statistical tests draw many tokens at once as a batch of identical rows with distinct, fixed noise
keys, and bound every token count by 6 binomial standard deviations (a false alarm has
probability ~1e-8 per token even without the fixed seeds, which make the tests deterministic).
"""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.worker_protocol import MAX_TOP_LOGPROBS
from worker_svc.sampling import (
    Sampler,
    SamplingBatch,
    SamplingParamError,
    SamplingParams,
    noise_key,
)

N_DRAWS = 20_000
# Sorted probabilities of the small statistical vocabulary (V = 8); shuffled into token order below
# so that "highest probability" never coincides with "lowest id".
PROBS = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.08, 0.04, 0.02, 0.01], dtype=torch.float64)
PERM = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
SMALL_LOGITS = torch.empty(8, dtype=torch.float32)
SMALL_LOGITS[PERM] = PROBS.log().float()  # token PERM[i] has probability PROBS[i]


def build(
    params: list[SamplingParams],
    vocab_size: int,
    *,
    seeds: list[int] | None = None,
    output_ids: list[list[int]] | None = None,
    prompt_ids: list[list[int]] | None = None,
    eos: frozenset[int] = frozenset(),
) -> SamplingBatch:
    B = len(params)
    seeds = seeds if seeds is not None else list(range(B))
    return SamplingBatch.build(
        params,
        [noise_key(s) for s in seeds],
        output_ids if output_ids is not None else [[] for _ in range(B)],
        prompt_ids if prompt_ids is not None else [[] for _ in range(B)],
        eos,
        vocab_size,
        "cpu",
    )


def draw_counts(logits: torch.Tensor, params: SamplingParams, n: int = N_DRAWS) -> torch.Tensor:
    """Token counts of ``n`` independent draws from one [V] logits vector."""
    V = logits.shape[0]
    batch = build([params] * n, V, seeds=[1_000_003 + i for i in range(n)])
    ids = Sampler().sample(logits.expand(n, V), batch).next_token_ids
    return torch.bincount(ids, minlength=V)


def assert_frequencies(counts: torch.Tensor, expected: torch.Tensor) -> None:
    n = int(counts.sum())
    for tok, (c, p) in enumerate(zip(counts.tolist(), expected.tolist(), strict=False)):
        if p == 0:
            assert c == 0, f"token {tok} is outside the allowed set but was drawn {c} times"
        else:
            sigma = math.sqrt(n * p * (1 - p))
            assert abs(c - n * p) <= 6 * sigma + 1, f"token {tok}: {c} draws, expected {n * p:.0f}"


def renormalized(keep: torch.Tensor) -> torch.Tensor:
    """PROBS restricted to sorted positions ``keep`` (bool [8]), renormalized, in token order."""
    p = torch.where(keep, PROBS, torch.zeros_like(PROBS))
    out = torch.empty_like(p)
    out[PERM] = p / p.sum()
    return out


def nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference nucleus: shortest prefix of the descending probabilities with mass >= top_p."""
    cum = sorted_probs.cumsum(0)
    size = int((cum < top_p).sum()) + 1
    return torch.arange(len(sorted_probs)) < size


# --- greedy ------------------------------------------------------------------------------------


def test_temperature_zero_is_argmax_on_fast_path() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000).to(torch.bfloat16)
    batch = build([SamplingParams(temperature=0.0)] * 16, 1000)
    assert batch.fast_greedy
    out = Sampler().sample(logits, batch)
    assert torch.equal(out.next_token_ids, logits.float().argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None and out.processed_logits is None


def test_temperature_zero_is_argmax_with_logprobs() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 500)
    batch = build([SamplingParams(temperature=0.0, return_logprob=True)] * 8, 500)
    assert not batch.fast_greedy
    out = Sampler().sample(logits, batch)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_top_k_1_equals_greedy() -> None:
    torch.manual_seed(2)
    B, V = 32, 2000
    logits = torch.randn(B, V) * 3
    greedy = Sampler().sample(logits, build([SamplingParams(temperature=0.0)] * B, V))
    # top_k=1 at various temperatures, mixed into a batch with genuinely sampled rows.
    params = [
        SamplingParams(temperature=[0.3, 0.7, 1.0, 1.7][i % 4], top_k=1)
        if i % 3
        else SamplingParams(temperature=1.0, top_p=0.9)
        for i in range(B)
    ]
    out = Sampler().sample(logits, build(params, V))
    rows = [i for i in range(B) if i % 3]
    assert torch.equal(out.next_token_ids[rows], greedy.next_token_ids[rows])


@pytest.mark.parametrize("V", [32000, 32001, 5000])
def test_wide_greedy_argmax_is_first_occurrence(V: int) -> None:
    # Integer logits tie a lot; the wide-row argmax must still return the first maximal index.
    g = torch.Generator().manual_seed(11)
    logits = torch.randint(0, 50, (16, V), generator=g).to(torch.bfloat16)
    logits[1] = 0.0  # all tied: index 0
    logits[2, -1] = 100.0  # maximum in the last (possibly short) chunk
    logits[3, [7, V - 3]] = 100.0  # two maxima far apart
    logits[4, [600, 601, 1030]] = 100.0  # tie across a chunk boundary
    out = Sampler().sample(logits, build([SamplingParams(temperature=0.0)] * 16, V))
    assert torch.equal(out.next_token_ids, logits.float().argmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, return_logprob=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, min_new_tokens=4),
        SamplingParams(temperature=0.5, min_p=0.1, frequency_penalty=0.4, top_logprobs_num=3),
    ],
)
def test_input_logits_are_not_modified(params: SamplingParams) -> None:
    torch.manual_seed(12)
    logits = torch.randn(3, 100)
    before = logits.clone()
    batch = build(
        [params] * 3, 100, output_ids=[[1, 2]] * 3, prompt_ids=[[3]] * 3, eos=frozenset({0})
    )
    Sampler().sample(logits, batch)
    assert torch.equal(logits, before)


def test_padded_vocab_columns_are_ignored() -> None:
    logits = torch.zeros(2, 12)
    logits[:, 10] = 100.0  # padding column beyond vocab_size must never be chosen
    logits[0, 3] = 1.0
    logits[1, 7] = 1.0
    out = Sampler().sample(logits, build([SamplingParams(temperature=0.0)] * 2, 10))
    assert out.next_token_ids.tolist() == [3, 7]


# --- reproducibility -----------------------------------------------------------------------------


def run_steps(
    params: list[SamplingParams],
    seeds: list[int],
    logits_steps: list[torch.Tensor],
    eos: frozenset[int] = frozenset(),
    prompts: list[list[int]] | None = None,
) -> list[list[int]]:
    """Decode len(logits_steps) steps; feeds each row's output back for penalties/min tokens."""
    B, V = logits_steps[0].shape
    keys = [noise_key(s) for s in seeds]
    prompts = prompts if prompts is not None else [[i % V, (7 * i + 3) % V] for i in range(B)]
    outputs: list[list[int]] = [[] for _ in range(B)]
    sampler = Sampler()
    for logits in logits_steps:
        batch = SamplingBatch.build(params, keys, outputs, prompts, eos, V, "cpu")
        ids = sampler.sample(logits, batch).next_token_ids.tolist()
        for row, tok in enumerate(ids):
            outputs[row].append(tok)
    return outputs


def random_steps(steps: int, B: int, V: int, seed: int, bf16: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(B, V, generator=g) * 2 for _ in range(steps)]
    # bf16 rounding creates many exactly tied logits, the hard case for order-independence.
    return [x.to(torch.bfloat16).float() for x in out] if bf16 else out


SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)


def test_seed_reproduces_sequence_and_different_seeds_differ() -> None:
    steps = random_steps(20, 1, 300, seed=3)
    a = run_steps([SAMPLED], [42], steps)
    b = run_steps([SAMPLED], [42], steps)
    c = run_steps([SAMPLED], [43], steps)
    assert a == b
    assert a != c


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize(
    "target",
    [
        SAMPLED,
        SamplingParams(temperature=1.3, top_p=0.8),  # full-sort path
        SamplingParams(temperature=0.7, min_p=0.05, frequency_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, top_k=5, min_new_tokens=6, stop_token_ids=(11,)),
    ],
)
def test_batch_composition_independence(target: SamplingParams, bf16: bool) -> None:
    V, steps_n, seed = 400, 12, 1234
    alone_steps = random_steps(steps_n, 1, V, seed=5, bf16=bf16)
    alone = run_steps([target], [seed], alone_steps, eos=frozenset({0}), prompts=[[1, 2, 3]])[0]

    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5),  # forces the full-sort view on the batch
        SamplingParams(temperature=0.5, top_k=300, return_logprob=True, top_logprobs_num=5),
        SamplingParams(temperature=1.0, presence_penalty=1.0, repetition_penalty=0.8),
        SamplingParams(temperature=2.0, min_p=0.3, top_k=1000),
    ]
    pos = 3
    params = others[:pos] + [target] + others[pos:]
    seeds = [100 + i for i in range(len(others))]
    seeds.insert(pos, seed)
    noise = random_steps(steps_n, len(params), V, seed=6, bf16=bf16)
    batched_steps = []
    for step, x in enumerate(noise):
        x = x.clone()
        x[pos] = alone_steps[step][0]
        batched_steps.append(x)
    prompts = [[5, 6] for _ in params]
    prompts[pos] = [1, 2, 3]
    batched = run_steps(params, seeds, batched_steps, eos=frozenset({0}), prompts=prompts)[pos]
    assert batched == alone


def test_top_p_partial_view_equals_full_sort() -> None:
    # Flat rows (high temperature) need most of the vocabulary for their nucleus, peaked rows only a
    # few tokens: with a partial view of 16 some rows close inside it and some force the full sort.
    B, V = 24, 500
    params = [
        SamplingParams(temperature=[0.2, 1.0, 5.0][i % 3], top_p=[0.5, 0.9, 0.99][i % 4 % 3])
        for i in range(B)
    ] + [SamplingParams(temperature=1.0, top_k=30, top_p=0.9)]
    steps = random_steps(8, B + 1, V, seed=8, bf16=True)
    runs = []
    for widths in ((16,), (4, 64), ()):
        keys = [noise_key(s) for s in range(B + 1)]
        sampler = Sampler(top_p_partial_widths=widths)
        empty: list[list[int]] = [[] for _ in params]
        ids = [
            sampler.sample(
                x, SamplingBatch.build(params, keys, empty, empty, frozenset(), V, "cpu")
            ).next_token_ids
            for x in steps
        ]
        runs.append(torch.stack(ids))
    assert torch.equal(runs[0], runs[2]) and torch.equal(runs[1], runs[2])


def test_a_rows_draw_depends_on_its_key_step_and_logits_alone() -> None:
    # Counter-based noise: a row's token at a step is fixed by (noise key, step, its logits), whatever was
    # sampled before (a retracted request resumes with the draws it would have had) or sits beside it.
    V = 300
    x = random_steps(1, 1, V, seed=9)[0]

    def token(step: int, key: int, others: int = 0) -> int:
        rows = torch.cat([x, random_steps(1, others, V, seed=others)[0]]) if others else x
        keys = [key] + [noise_key(50 + i) for i in range(others)]
        batch = SamplingBatch.build([SamplingParams(temperature=1.0)] * (1 + others), keys,
                                    [[0] * step] * (1 + others), [[1]] * (1 + others), frozenset(), V, "cpu")
        return int(Sampler().sample(rows, batch).next_token_ids[0])

    assert token(5, 11) == token(5, 11, others=3) == token(5, 11, others=7)
    assert len({token(step, 11) for step in range(40)}) > 5  # the step moves the noise
    assert len({token(5, key) for key in range(40)}) > 5  # so does the key


# --- distributions -------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies(temperature: float) -> None:
    counts = draw_counts(SMALL_LOGITS, SamplingParams(temperature=temperature))
    expected = torch.softmax(SMALL_LOGITS.double() / temperature, dim=0)
    assert_frequencies(counts, expected)


def test_top_k_frequencies() -> None:
    counts = draw_counts(SMALL_LOGITS, SamplingParams(top_k=3))
    assert_frequencies(counts, renormalized(torch.arange(8) < 3))


def test_top_p_frequencies() -> None:
    keep = nucleus(PROBS, 0.8)
    assert int(keep.sum()) == 4  # 0.35 + 0.25 + 0.15 = 0.75 < 0.8 <= 0.85
    counts = draw_counts(SMALL_LOGITS, SamplingParams(top_p=0.8))
    assert_frequencies(counts, renormalized(keep))


def test_min_p_frequencies() -> None:
    keep = 0.2 * PROBS.max() <= PROBS  # 0.07: keeps 0.35 .. 0.08
    assert int(keep.sum()) == 5
    counts = draw_counts(SMALL_LOGITS, SamplingParams(min_p=0.2))
    assert_frequencies(counts, renormalized(keep))


def test_top_p_applies_to_top_k_renormalized() -> None:
    # Top-5 renormalized: 0.376, 0.269, 0.161, ... -> cumulative 0.806 >= 0.8 after 3 tokens
    # (without renormalization it would take 4).
    top5 = PROBS[:5] / PROBS[:5].sum()
    keep = torch.cat([nucleus(top5, 0.8), torch.zeros(3, dtype=torch.bool)])
    assert int(keep.sum()) == 3
    counts = draw_counts(SMALL_LOGITS, SamplingParams(top_k=5, top_p=0.8))
    assert_frequencies(counts, renormalized(keep))


def test_combined_truncation_with_temperature() -> None:
    T = 1.5
    p = torch.softmax(PROBS.log() / T, dim=0)  # sorted order is unchanged by temperature
    keep = nucleus(p[:6] / p[:6].sum(), 0.7)
    keep = torch.cat([keep, torch.zeros(2, dtype=torch.bool)]) & (p >= 0.3 * p.max())
    counts = draw_counts(SMALL_LOGITS, SamplingParams(temperature=T, top_k=6, top_p=0.7, min_p=0.3))
    q = torch.where(keep, p, torch.zeros_like(p))
    expected = torch.empty_like(q)
    expected[PERM] = q / q.sum()
    assert_frequencies(counts, expected)


def test_top_k_keeps_ties_with_the_kth_token() -> None:
    # Sorted probabilities with the 3rd and 4th tied: top_k=3 keeps both (threshold semantics).
    tied = torch.tensor([0.30, 0.20, 0.15, 0.15, 0.10, 0.05, 0.03, 0.02], dtype=torch.float64)
    tied_logits = torch.empty(8)
    tied_logits[PERM] = tied.log().float()
    half = N_DRAWS // 2
    # Tied rows race over the full vocabulary, untied rows inside their top-k view; one batch.
    logits = torch.cat([tied_logits.expand(half, 8), SMALL_LOGITS.expand(half, 8)])
    seeds = [7_000 + i for i in range(2 * half)]
    batch = build([SamplingParams(top_k=3)] * (2 * half), 8, seeds=seeds)
    ids = Sampler().sample(logits, batch).next_token_ids
    keep = torch.arange(8) < 4
    expected = torch.empty(8, dtype=torch.float64)
    expected[PERM] = torch.where(keep, tied, torch.zeros_like(tied)) / tied[:4].sum()
    assert_frequencies(torch.bincount(ids[:half], minlength=8), expected)
    assert_frequencies(torch.bincount(ids[half:], minlength=8), renormalized(torch.arange(8) < 3))


def test_tokens_outside_allowed_set_never_appear() -> None:
    torch.manual_seed(4)
    V, B = 1000, 4000
    logits = torch.randn(V) * 2
    allowed = set(torch.topk(logits, 10).indices.tolist())
    counts = draw_counts(logits, SamplingParams(temperature=1.5, top_k=10), n=B)
    drawn = set(torch.nonzero(counts).view(-1).tolist())
    assert drawn <= allowed
    assert len(drawn) >= 5  # and it does sample, not just argmax


# --- penalties and masks -------------------------------------------------------------------------


def processed(
    logits: torch.Tensor,
    params: SamplingParams,
    output_ids: list[int],
    prompt_ids: list[int],
    eos: frozenset[int] = frozenset(),
) -> torch.Tensor:
    params = SamplingParams(**{**params.__dict__, "return_logprob": True})
    V = logits.shape[-1]
    batch = build([params], V, output_ids=[output_ids], prompt_ids=[prompt_ids], eos=eos)
    out = Sampler().sample(logits.view(1, V), batch)
    assert out.processed_logits is not None
    return out.processed_logits[0]


def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([2.0, -1.0, 3.0, -2.0, 0.5, 1.0, -0.5, 4.0])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    got = processed(logits, params, [2, 3], [0, 1, 3])
    # seen = {0, 1, 2, 3}: positive / 2, negative * 2; others untouched.
    expected = torch.tensor([1.0, -2.0, 1.5, -4.0, 0.5, 1.0, -0.5, 4.0])
    assert torch.equal(got, expected)


def test_frequency_and_presence_penalties_exact() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, -1.0, 0.0, 5.0])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    # Output counts: token 1 x3, token 4 x1. Prompt token 5 is ignored by these penalties.
    got = processed(logits, params, [1, 4, 1, 1], [5, 5, 2])
    expected = torch.tensor([1.0, 2.0 - 1.5 - 0.25, 3.0, -1.0, 0.0 - 0.5 - 0.25, 5.0])
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)


def test_penalties_then_temperature() -> None:
    logits = torch.tensor([1.0, 2.0, -3.0, 4.0])
    params = SamplingParams(
        temperature=0.5, repetition_penalty=1.25, frequency_penalty=1.0, presence_penalty=0.5
    )
    got = processed(logits, params, [2, 2], [3])
    # rep over {2, 3}: -3 * 1.25 = -3.75, 4 / 1.25 = 3.2; then token 2: -2 - 0.5; then / 0.5.
    expected = torch.tensor([1.0, 2.0, -3.75 - 2.0 - 0.5, 3.2]) / 0.5
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([9.0, 1.0, 2.0, 8.0, 0.0])  # eos=0 and stop=3 dominate
    eos = frozenset({0})
    params = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=(3,))
    got = processed(logits, params, [1, 1], [], eos)
    assert got[0] == -math.inf and got[3] == -math.inf
    assert torch.equal(got[[1, 2, 4]], logits[[1, 2, 4]])
    batch = build([params], 5, output_ids=[[1, 1]], eos=eos)
    assert Sampler().sample(logits.view(1, 5), batch).next_token_ids.item() == 2
    # Reached: nothing masked, EOS is an ordinary token again.
    assert torch.equal(processed(logits, params, [1, 1, 1], [], eos), logits)
    # ignore_eos: EOS does not finish the request, so only the stop id is masked.
    ign = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=(3,), ignore_eos=True)
    got = processed(logits, ign, [1], [], eos)
    assert got[0] == 9.0 and got[3] == -math.inf


def test_min_new_tokens_masks_in_sampled_rows() -> None:
    logits = torch.zeros(6)
    params = SamplingParams(temperature=1.0, min_new_tokens=2, stop_token_ids=(4, 5))
    n = 3000
    batch = build([params] * n, 6, output_ids=[[1]] * n, eos=frozenset({0}))
    ids = Sampler().sample(logits.expand(n, 6), batch).next_token_ids
    assert set(ids.tolist()) == {1, 2, 3}


# --- logprobs ------------------------------------------------------------------------------------


def test_logprobs_and_top_logprobs() -> None:
    torch.manual_seed(5)
    B, V = 6, 300
    logits = (torch.randn(B, V) * 3).to(torch.float16)
    params = [
        SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=3),
        SamplingParams(temperature=0.7, top_k=20, return_logprob=True, top_logprobs_num=5),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=0.5, top_k=1, return_logprob=True),
        SamplingParams(temperature=1.0, min_p=0.1, top_logprobs_num=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, return_logprob=True),
    ]
    out = Sampler().sample(logits, build(params, V, output_ids=[[1, 2]] * B, prompt_ids=[[3]] * B))
    assert out.processed_logits is not None and out.logprobs is not None
    assert out.top_logprobs is not None
    x = logits.float()
    # Greedy rows (temperature 0 and top_k 1) use T = 1; sampled rows are divided by T.
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 1.0]).view(B, 1)
    expected_processed = x / temps
    seen = [1, 2, 3]
    expected_processed[5, seen] = torch.where(
        x[5, seen] > 0, x[5, seen] / 1.3, x[5, seen] * 1.3
    )
    assert torch.allclose(out.processed_logits, expected_processed, atol=1e-6, rtol=1e-6)
    ref = torch.log_softmax(out.processed_logits, dim=-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.next_token_ids.view(B, 1)).view(B))
    ids, values = out.top_logprobs
    assert ids.shape == values.shape == (B, 5)
    ref_values, ref_ids = torch.topk(ref, 5, dim=-1)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(values, ref_values)
    # Greedy rows chose the top logprob.
    assert torch.equal(out.next_token_ids[[0, 3, 5]], ids[[0, 3, 5], 0])


def test_no_logprobs_unless_asked() -> None:
    out = Sampler().sample(torch.randn(2, 10), build([SamplingParams(top_k=3)] * 2, 10))
    assert out.logprobs is None and out.top_logprobs is None and out.processed_logits is None


# --- params --------------------------------------------------------------------------------------

INVALID = [
    ("max_new_tokens", {"max_new_tokens": 0}),
    ("max_new_tokens", {"max_new_tokens": -5}),
    ("max_new_tokens", {"max_new_tokens": 201}),  # over the limit of 200 used below
    ("min_new_tokens", {"min_new_tokens": -1}),
    ("min_new_tokens", {"min_new_tokens": 11, "max_new_tokens": 10}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": math.nan}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": -0.5}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": math.nan}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("frequency_penalty", {"frequency_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -2.5}),
    ("frequency_penalty", {"frequency_penalty": math.nan}),
    ("presence_penalty", {"presence_penalty": 2.01}),
    ("presence_penalty", {"presence_penalty": -3.0}),
    ("stop_token_ids", {"stop_token_ids": (5, 1000)}),
    ("stop_token_ids", {"stop_token_ids": (-1,)}),
    ("n", {"n": 0}),
    ("top_logprobs_num", {"top_logprobs_num": -1}),
    ("top_logprobs_num", {"top_logprobs_num": MAX_TOP_LOGPROBS + 1}),
]


@pytest.mark.parametrize(
    ("field", "kwargs"), INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)]
)
def test_validation_names_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(SamplingParamError) as info:
        params = SamplingParams(**kwargs)  # type: ignore[arg-type]
        params.validate(vocab_size=1000, max_new_tokens_limit=200)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_valid_params_pass() -> None:
    SamplingParams().validate(vocab_size=1000)
    SamplingParams(
        max_new_tokens=100, min_new_tokens=100, temperature=0.0, top_k=0, top_p=1.0, min_p=1.0,
        repetition_penalty=0.5, frequency_penalty=-2.0, presence_penalty=2.0, seed=-3,
        stop_token_ids=(0, 999), n=4, return_logprob=True, top_logprobs_num=MAX_TOP_LOGPROBS,
    ).validate(vocab_size=1000, max_new_tokens_limit=100)


def test_normalized_maps_proto3_zero_values() -> None:
    p = SamplingParams(top_p=0.0, top_k=0, repetition_penalty=0.0, temperature=0.0).normalized()
    assert (p.top_p, p.top_k, p.repetition_penalty, p.temperature) == (1.0, -1, 1.0, 0.0)
    p.validate(vocab_size=10)
    q = SamplingParams(top_p=0.5, top_k=7)
    assert q.normalized() is q
    from_proto = SamplingParams(stop_token_ids=[1, 2])  # type: ignore[arg-type]
    assert from_proto.normalized().stop_token_ids == (1, 2)


def test_greedy_flags() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy  # 1/T would overflow float32 logits
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy
    assert not SamplingParams().is_greedy


def test_top_k_at_least_vocab_is_off() -> None:
    steps = random_steps(5, 4, 64, seed=13)
    off = run_steps([SamplingParams(temperature=0.9)] * 4, [1, 2, 3, 4], steps)
    wide = run_steps([SamplingParams(temperature=0.9, top_k=64 + 5)] * 4, [1, 2, 3, 4], steps)
    assert off == wide


def test_build_rejects_inconsistent_inputs() -> None:
    none: frozenset[int] = frozenset()
    with pytest.raises(ValueError):  # a sampled row without a noise key
        SamplingBatch.build([SamplingParams()], [None], [[]], [[]], none, 10, "cpu")
    with pytest.raises(ValueError):  # lengths differ
        SamplingBatch.build(
            [SamplingParams()] * 2, [noise_key(0)], [[]], [[]], none, 10, "cpu"
        )
    # Greedy rows need no noise key.
    SamplingBatch.build([SamplingParams(temperature=0.0)], [None], [[]], [[]], none, 10, "cpu")


def test_noise_key_seeding() -> None:
    assert noise_key(5) == noise_key(5) == 5
    assert noise_key(-1) == (1 << 64) - 1  # folded into 64 bits rather than rejected
    assert noise_key(1 << 70 | 3) == 3
    assert noise_key(None) != noise_key(None)
