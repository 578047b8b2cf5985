"""--prefill-batching cost (engine/admission.py): the step-time fit, the split of the waiting queue into
steps, and the scheduler admitting by it on the tiny model (same tokens as admitting by the budget)."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.unit.kv_invariants import assert_all_released, assert_kv_consistent
from worker_svc.config.engine_config import EngineConfig
from worker_svc.engine.admission import (
    NEAR_TIE,
    StepCoefficients,
    StepTimeModel,
    StepWork,
    first_batch_size,
)
from worker_svc.engine.engine import Engine
from worker_svc.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def _splits(n: int):
    """Every split of n queued requests into consecutive steps, as step sizes."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 1
            else:
                size += 1
        yield [*sizes, size]


def _summed_ttft(sizes: list[int], own: list[float], fixed: float) -> float:
    total, clock, start = 0.0, 0.0, 0
    for size in sizes:
        clock += fixed + sum(own[start : start + size])
        total += size * clock
        start += size
    return total


def _within_budget(sizes: list[int], tokens: list[int], budget: int) -> bool:
    start = 0
    for size in sizes:
        if size > 1 and sum(tokens[start : start + size]) > budget:
            return False
        start += size
    return True


@pytest.mark.parametrize("seed", range(40))
def test_first_batch_against_every_split(seed):
    """Against every split of up to 8 requests: the returned first step is the smallest whose best split
    comes within NEAR_TIE x (the least split's first step: its requests x its time) of the least sum."""
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    own = [rng.uniform(1, 40) for _ in range(n)]
    tokens = [rng.randint(1, 200) for _ in range(n)]
    fixed, budget = rng.uniform(1, 60), rng.choice([128, 256, 512, 4096])
    best_by_first: dict[int, float] = {}
    for sizes in _splits(n):
        if _within_budget(sizes, tokens, budget):
            cost = _summed_ttft(sizes, own, fixed)
            best_by_first[sizes[0]] = min(best_by_first.get(sizes[0], cost), cost)
    least = min(best_by_first.values())
    first = min(k for k, cost in best_by_first.items() if cost == least)
    slack = NEAR_TIE * first * (fixed + sum(own[:first]))
    expected = min(k for k, cost in best_by_first.items() if cost - least <= slack + 1e-9)
    assert first_batch_size(own, tokens, fixed, budget) == expected


def test_the_split_follows_fixed_cost_against_own_cost():
    # A step's fixed part dwarfs the requests' own: one step for all (the budget allowing).
    assert first_batch_size([1.0] * 6, [64] * 6, fixed_ms=100.0, token_budget=512) == 6
    assert first_batch_size([1.0] * 6, [128] * 6, fixed_ms=100.0, token_budget=512) == 4  # the budget
    # Own parts dwarf the fixed part: one a step (shortest first is the rest of the order).
    assert first_batch_size([40.0] * 3, [64] * 3, fixed_ms=1.0, token_budget=512) == 1
    # The served prefix workload's 5 cached prompts (64 new tokens over 512 each, fixed 16.5 ms, own
    # 14.1 ms): 3 + 2 is least (383.4 ms summed, 5 at once 435.0); 2 + 2 + 1 (388.2) is within a tenth of what
    # the 3 wait for their step (176 ms): the smaller step.
    assert first_batch_size([14.1] * 5, [64] * 5, fixed_ms=16.5, token_budget=512) == 2
    # Two of them: one a step (91.8 ms summed) is within a tenth of a pair's step (89.4 ms) of the pair.
    assert first_batch_size([14.1] * 2, [64] * 2, fixed_ms=16.5, token_budget=512) == 1
    # A burst of 64 prompts of 128 tokens (fixed 20 ms, own 27): budget-sized steps of 4; a smaller first step
    # would hold all 60 behind it back by another fixed part.
    assert first_batch_size([27.0] * 64, [128] * 64, fixed_ms=20.0, token_budget=512) == 4
    # The fixed part dwarfs the own parts: a pair stays a pair.
    assert first_batch_size([1.0] * 2, [8] * 2, fixed_ms=100.0, token_budget=512) == 2
    assert first_batch_size([], [], fixed_ms=1.0, token_budget=512) == 0
    assert first_batch_size([5.0], [900], fixed_ms=1.0, token_budget=512) == 1  # alone it is chunked


def _true_ms(work: StepWork, c: StepCoefficients) -> float:
    return c.fixed_ms(work.rows, work.row_pairs) + c.prompt_ms(work.prompt_tokens, work.prompt_pairs)


def _served_like_steps(rng: random.Random, count: int):
    """Decode steps of 4-16 requests and, every fifth step, an extend step of 1-6 prompts of 64-128 new
    tokens over 0-512 cached, with riders."""
    for i in range(count):
        rows = rng.randint(4, 16)
        row_pairs = rows * (rng.randint(100, 700) + 1)
        if i % 5 == 4:
            prompts = [(rng.choice([64, 128]), rng.choice([0, 512])) for _ in range(rng.randint(1, 6))]
            yield StepWork(prompt_tokens=sum(n for n, _ in prompts),
                           prompt_pairs=sum(StepWork.pairs(n, p) for n, p in prompts), rows=rows, row_pairs=row_pairs)
        else:
            yield StepWork(prompt_tokens=0, prompt_pairs=0.0, rows=rows, row_pairs=row_pairs)


def test_the_fit_recovers_a_linear_step_time_and_follows_a_slowdown():
    truth = StepCoefficients(fixed=16.5, per_row=0.4, per_row_kpair=0.03, per_token=0.2, per_kpair=0.03)
    model = StepTimeModel()
    rng = random.Random(3)
    steps = list(_served_like_steps(rng, 200))
    for work in steps[:4]:
        model.observe(work, _true_ms(work, truth))
    assert model.coefficients() is None  # no extend step seen yet
    for work in steps[4:]:
        model.observe(work, _true_ms(work, truth) * rng.uniform(0.95, 1.05))  # 5% noise
    fit = model.coefficients()
    assert fit is not None
    assert fit.fixed_ms(8, 8 * 600) == pytest.approx(truth.fixed_ms(8, 8 * 600), rel=0.05)
    assert fit.per_token == pytest.approx(truth.per_token, rel=0.15)
    # What admission asks: a cached 64-token prompt's own part against the fixed part.
    own = fit.prompt_ms(64, StepWork.pairs(64, 512))
    assert own == pytest.approx(truth.prompt_ms(64, StepWork.pairs(64, 512)), rel=0.1)
    # The host slows down 2x: within ~50 steps (10 extend steps) the fit has followed.
    slow = StepCoefficients(fixed=33.0, per_row=0.8, per_row_kpair=0.06, per_token=0.4, per_kpair=0.06)
    for work in _served_like_steps(rng, 60):
        model.observe(work, _true_ms(work, slow))
    fit = model.coefficients()
    assert fit is not None and fit.fixed_ms(8, 8 * 600) == pytest.approx(slow.fixed_ms(8, 8 * 600), rel=0.05)
    assert fit.per_token == pytest.approx(slow.per_token, rel=0.15)


def test_decode_steps_of_one_size_put_their_time_in_the_fixed_part():
    """Every decode step of 8 requests at one context cannot tell the fixed part from a row's: the time goes
    to the fixed part (what a step of fewer riders costs is about the same, weights dominate), and the
    extend steps' time beyond it to their prompts."""
    model = StepTimeModel()
    for _ in range(20):
        model.observe(StepWork(prompt_tokens=0, prompt_pairs=0.0, rows=8, row_pairs=8 * 600), 18.0)
    for _ in range(5):
        model.observe(StepWork(prompt_tokens=192, prompt_pairs=3 * StepWork.pairs(64, 512), rows=8,
                               row_pairs=8 * 600), 18.0 + 192 * 0.3)
    fit = model.coefficients()
    assert fit is not None
    assert fit.fixed == pytest.approx(18.0, rel=0.02) and fit.fixed_ms(3, 3 * 600) == pytest.approx(18.0, rel=0.02)
    assert fit.prompt_ms(192, 3 * StepWork.pairs(64, 512)) == pytest.approx(192 * 0.3, rel=0.02)


class FixedCosts:
    """A step-cost estimator that knows the costs (the scheduler test decides them, not the host)."""

    def __init__(self, coefficients: StepCoefficients) -> None:
        self.fit = coefficients
        self.observed = 0

    def observe(self, work: StepWork, ms: float) -> None:
        self.observed += 1

    def coefficients(self) -> StepCoefficients:
        return self.fit


def _engine(tiny_model, batching: str, costs: FixedCosts | None = None) -> Engine:
    config = EngineConfig(model_path=str(tiny_model), dtype="float32", max_total_tokens=1024,
                          max_running_requests=8, chunked_prefill_size=64, max_prefill_tokens=128,
                          context_length=256, prefill_batching=batching)
    return Engine(config, step_costs=costs)


def _burst_on_a_cached_prefix(engine: Engine) -> tuple[list, list[int]]:
    """A 48-token prefix computed and cached, then 5 prompts on it at once; the extend steps' sizes."""
    rng = random.Random(5)
    prefix = [rng.randrange(500) for _ in range(48)]
    engine.generate([prefix + [1]], GREEDY)
    reqs = [engine.submit(prefix + [rng.randrange(500) for _ in range(8)], GREEDY) for _ in range(5)]
    sizes = []
    while engine.scheduler.has_work():
        engine.scheduler.step()
        assert_kv_consistent(engine)
        shape = engine.scheduler.last_step
        if shape is not None and shape.mode == "extend":
            sizes.append(shape.extends)
    assert_all_released(engine)
    return reqs, sizes


def test_the_scheduler_splits_a_burst_by_the_costs_and_the_tokens_do_not_change(tiny_model):
    """Costs where the requests' own parts count (fixed 16.5 ms, 8 new tokens over 48 cached = 14 ms): the 5
    cached prompts go 2 + 2 + 1, as first_batch_size says step by step; where the fixed part dwarfs them, all
    5 at once, as under the budget. Greedy tokens identical either way, KV whole after each."""
    own_costly = StepCoefficients(fixed=16.5, per_row=0.0, per_row_kpair=0.0, per_token=14.1 / 8, per_kpair=0.0)
    fixed_costly = StepCoefficients(fixed=100.0, per_row=0.1, per_row_kpair=0.0, per_token=0.01, per_kpair=0.0)
    budget_reqs, budget_sizes = _burst_on_a_cached_prefix(_engine(tiny_model, "budget"))
    costs = FixedCosts(own_costly)
    split_reqs, split_sizes = _burst_on_a_cached_prefix(_engine(tiny_model, "cost", costs))
    whole_reqs, whole_sizes = _burst_on_a_cached_prefix(_engine(tiny_model, "cost", FixedCosts(fixed_costly)))
    assert budget_sizes == whole_sizes == [5]
    assert split_sizes == [2, 2, 1]
    assert costs.observed > 0  # told every step
    assert [r.output_ids for r in split_reqs] == [r.output_ids for r in budget_reqs] == [
        r.output_ids for r in whole_reqs]
    assert all(r.cached_prompt_tokens == 48 for r in split_reqs)


def test_cost_batching_random_workload_keeps_kv_whole_and_tokens(tiny_model):
    """Arrivals while others run, prompts long enough to chunk, a small pool: one request a step (own parts
    dwarf the fixed part) gives the same tokens as the budget and never leaks a slot."""
    one_a_step = StepCoefficients(fixed=0.001, per_row=0.0, per_row_kpair=0.0, per_token=1.0, per_kpair=0.0)
    rng = random.Random(9)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(1, 150))] for _ in range(12)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True) for _ in prompts]
    outputs = {}
    for batching, costs in (("budget", None), ("cost", FixedCosts(one_a_step))):
        engine = _engine(tiny_model, batching, costs)
        reqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            reqs.append(engine.submit(prompt, p))
            if i % 3 == 2:
                engine.scheduler.step()
                assert_kv_consistent(engine)
        while engine.scheduler.has_work():
            engine.scheduler.step()
            assert_kv_consistent(engine)
        assert_all_released(engine)
        outputs[batching] = [r.output_ids for r in reqs]
    assert outputs["cost"] == outputs["budget"]


def test_prefill_batching_is_checked():
    with pytest.raises(ValueError, match="--prefill-batching"):
        EngineConfig(model_path="m", prefill_batching="fastest")
