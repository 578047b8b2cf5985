"""The radix prefix cache in the engine (worker_svc/engine/scheduler.py over kvcache/radix_cache.py), on
tiny fp32 models: with the cache on, greedy (and seeded sampled) outputs and their logprobs equal the
cache-off engine's over mixed workloads (shared prefixes arriving while others run, chunked prefill,
multi-turn continuations, n > 1, retraction under a small pool, eviction under pressure), for Llama
and DeepSeek-V2's MLA latent pool, and at TP=2 where the follower's request -> token rows equal the
leader's at every step; the prefix really is reused (a repeated 200-token prompt prefills one token
and reports 199 cached tokens); every slot is in exactly one place after every step, and after the
workload and a FlushCache the pool is whole again."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ranks import gloo_groups, on_ranks
from tests.unit.kv_invariants import assert_all_released, assert_kv_consistent, cached_slots
from worker_svc.config.engine_config import EngineConfig
from worker_svc.engine.engine import Engine
from worker_svc.engine.request import Request
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.executor.tp_runners import FollowerLoop, LeaderRunner
from worker_svc.forward_batch import ForwardMode, StepInput
from worker_svc.parallel.context import TPContext
from worker_svc.sampling import SamplingParams

ATOL = 1e-4
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, return_logprob=True,
                        top_logprobs_num=3)
# Hot and seeded: draws leave the argmax path, so a recomputed or re-pointed KV that changed anything shows.
SAMPLED = dataclasses.replace(GREEDY, temperature=3.0, top_p=0.95, seed=11)


class RecordingRunner:
    """The real runner, recording each step's mode, token count and (after the step) the rows of its
    requests up to their new lengths; everything else is the wrapped runner's."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.steps: list[tuple[ForwardMode, int, list[list[int]]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def forward(self, step: StepInput) -> torch.Tensor:
        logits = self.runner.forward(step)
        table = self.runner.kv.req_table
        rows = [table.slots(row, seq).tolist() for row, seq in zip(step.req_rows.tolist(), step.seq_lens, strict=True)]
        self.steps.append((step.mode, int(step.input_ids.numel()), rows))
        return logits


def _config(model_dir: Path, **kw: Any) -> EngineConfig:
    """Tests that expect given requests in given steps pass ``prefill_batching="budget"`` (under "cost" the
    split of a burst follows the measured step times)."""
    base: dict[str, Any] = dict(model_path=str(model_dir), dtype="float32", max_total_tokens=1024,
                                max_running_requests=6, chunked_prefill_size=16, max_prefill_tokens=32,
                                context_length=256)
    return EngineConfig(**{**base, **kw})


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(500) for _ in range(n)]


Arrival = tuple[int, list[int], SamplingParams]  # (step it arrives before, prompt, params); params.n samples


def _mixed_workload(seed: int = 0) -> list[Arrival]:
    """A 40-token shared system prompt under several users, one arriving while the others run; a long
    prompt chunk-prefilled beside them; a prompt extending another's whole prompt; n = 3 greedy and
    n = 2 seeded samples of one prompt; and a request with a prompt of one token."""
    rng = random.Random(seed)
    system, long_doc = _tokens(rng, 40), _tokens(rng, 70)
    user_a = system + _tokens(rng, 9)
    return [
        (0, user_a, GREEDY),
        (0, long_doc, dataclasses.replace(GREEDY, max_new_tokens=6)),
        (2, system + _tokens(rng, 5), GREEDY),  # arrives while user_a decodes: hits the system prompt
        (4, user_a + _tokens(rng, 7), GREEDY),  # extends user_a's prompt
        (5, system + _tokens(rng, 12), dataclasses.replace(GREEDY, n=3)),
        (5, long_doc[:50] + _tokens(rng, 4), dataclasses.replace(SAMPLED, n=2)),  # hits the chunked doc
        (9, _tokens(rng, 1), GREEDY),
        (14, system + _tokens(rng, 3), dataclasses.replace(GREEDY, max_new_tokens=20)),
    ]


def _run(engine: Engine, arrivals: list[Arrival], check: bool = True) -> list[Request]:
    """Submit each arrival before its step (n samples as n requests, seeds seed + i as the servicer
    does), step to the end checking the KV invariants after every step; requests in submission order."""
    reqs: list[Request] = []
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or engine.scheduler.has_work():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            for i in range(params.n):
                seed = None if params.seed is None else params.seed + i
                reqs.append(engine.submit(prompt, dataclasses.replace(params, seed=seed)))
        engine.scheduler.step()
        if check:
            assert_kv_consistent(engine)
        step += 1
    assert all(r.finished and r.error is None for r in reqs)
    return reqs


def _assert_same_outputs(on: list[Request], off: list[Request]) -> None:
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    for a, b in zip(on, off, strict=True):
        assert len(a.output_logprobs) == len(b.output_logprobs) == len(a.output_ids)
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), rtol=0, atol=ATOL)
        top_a = torch.tensor([[lp for _, lp in step] for step in a.output_top_logprobs])
        top_b = torch.tensor([[lp for _, lp in step] for step in b.output_top_logprobs])
        assert [[t for t, _ in s] for s in a.output_top_logprobs] == [[t for t, _ in s] for s in b.output_top_logprobs]
        torch.testing.assert_close(top_a, top_b, rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def models(model_factory) -> dict[str, Path]:
    return {"llama": model_factory("tiny"), "deepseek_v2": model_factory("tiny", arch="deepseek_v2")}


# ---- reuse ---------------------------------------------------------------------------------------


def test_a_repeated_200_token_prompt_prefills_one_token_and_reports_199_cached(models):
    runner = RecordingRunner(ModelRunner(_config(models["llama"], chunked_prefill_size=64, max_prefill_tokens=64)))
    engine = Engine(runner.engine_config, runner=runner)
    prompt = _tokens(random.Random(5), 200)
    params = dataclasses.replace(GREEDY, max_new_tokens=4)

    def prefill_tokens(req: Request) -> tuple[int, list]:
        runner.steps.clear()
        outputs = []
        while engine.scheduler.has_work():
            outputs += [o for o in engine.scheduler.step() if o.rid == req.rid]
        return sum(n for mode, n, _ in runner.steps if mode is ForwardMode.EXTEND), outputs

    first = engine.submit(prompt, params)
    first_tokens, first_out = prefill_tokens(first)
    second = engine.submit(prompt, params)
    second_tokens, second_out = prefill_tokens(second)
    assert first_tokens == 200 and second_tokens == 1  # 4 chunks of 64/8, then 199 of 200 cached
    assert [o.cached_tokens for o in first_out] == [0] * 4 and [o.cached_tokens for o in second_out] == [199] * 4
    assert second.cached_prompt_tokens == 199 and engine.scheduler.prompt_tokens_cached == 199
    assert second.output_ids == first.output_ids
    torch.testing.assert_close(torch.tensor(second.output_logprobs), torch.tensor(first.output_logprobs),
                               rtol=0, atol=ATOL)
    # The first request's prompt and all but its last output token are cached: 203 tokens.
    assert engine.scheduler.counts().cached_tokens == 203
    assert_all_released(engine)


def test_samples_of_one_prompt_share_its_kv_after_their_prefill(models):
    """n = 3 samples admitted in one step each compute the prompt once; the step after, their rows
    point at one cached copy and the duplicates are free again."""
    engine = Engine(_config(models["llama"], chunked_prefill_size=64, max_prefill_tokens=128,
                            prefill_batching="budget"))
    prompt = _tokens(random.Random(6), 30)
    reqs = [engine.submit(prompt, dataclasses.replace(SAMPLED, seed=i)) for i in range(3)]
    engine.scheduler.step()
    table = engine.runner.kv.req_table
    heads = [table.slots(r.req_row, 30).tolist() for r in reqs]
    assert heads[0] == heads[1] == heads[2] == cached_slots(engine.scheduler.cache, prompt)
    assert engine.runner.kv.allocator.available() == engine.runner.kv.allocator.size - 30
    assert_kv_consistent(engine)
    engine.run_until_idle()
    assert len({tuple(r.output_ids) for r in reqs}) == 3  # still independent draws
    assert_all_released(engine)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_a_burst_on_a_new_shared_prefix_computes_it_once(models, arch):
    """Requests arriving together on a 100-token prefix nobody has computed yet (a new system prompt; the n
    samples of a long prompt): the first computes it (in chunks), the others wait for it in the queue and
    take it from the cache (sglang's in-batch prefix caching) while an unrelated request behind them goes
    ahead. Same outputs as the cache-off engine, which computes the prefix for each of them."""
    rng = random.Random(12)
    shared = _tokens(rng, 100)
    arrivals: list[Arrival] = [
        (0, shared + _tokens(rng, 10), GREEDY),
        (0, shared + _tokens(rng, 6), GREEDY),
        (0, _tokens(rng, 40), GREEDY),  # unrelated: not held behind the waiting ones
        (0, shared + _tokens(rng, 8), dataclasses.replace(SAMPLED, n=2)),
    ]
    results, computed = {}, {}
    for radix in (False, True):
        # Without mixed steps every token of an extend step is a prompt token.
        runner = RecordingRunner(ModelRunner(_config(models[arch], disable_radix_cache=not radix,
                                                     chunked_prefill_size=64, max_prefill_tokens=128,
                                                     enable_mixed_chunk=False, prefill_batching="budget")))
        engine = Engine(runner.engine_config, runner=runner)
        results[radix] = _run(engine, arrivals)
        computed[radix] = sum(n for mode, n, _ in runner.steps if mode is ForwardMode.EXTEND)
        assert_all_released(engine)
    _assert_same_outputs(results[True], results[False])
    on = results[True]
    assert [r.cached_prompt_tokens for r in on] == [0, 100, 0, 100, 100]  # the prefix, once for four requests
    assert computed[False] == 110 + 106 + 40 + 2 * 108 and computed[True] == 110 + 6 + 40 + 2 * 8
    # The unrelated request was admitted before the ones waiting for the prefix: it decoded first.
    assert on[2].first_token_time is not None and on[1].first_token_time is not None
    assert on[2].first_token_time < on[1].first_token_time


def test_flush_cache_is_refused_while_requests_run(models):
    engine = Engine(_config(models["llama"]))
    req = engine.submit(_tokens(random.Random(7), 12), GREEDY)
    engine.scheduler.step()
    ok, message = engine.flush_cache()
    assert not ok and "1 request(s) running or waiting" in message
    assert engine.scheduler.cache is not None and engine.scheduler.cache.total_size() == 12  # untouched
    engine.run_until_idle()
    assert req.finished
    ok, message = engine.flush_cache()
    assert ok and message == f"flushed {12 + GREEDY.max_new_tokens - 1} cached tokens"
    assert engine.runner.kv.allocator.available() == engine.runner.kv.allocator.size
    off = Engine(_config(models["llama"], disable_radix_cache=True))
    ok, message = off.flush_cache()
    assert off.scheduler.cache is None and ok and "disabled" in message


# ---- cache on == cache off -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_mixed_workload_matches_the_cache_off_engine(models, arch):
    """Shared prefixes (one arriving while others run), chunked prefill, a prompt extending another's,
    n > 1 greedy and seeded: same tokens, logprobs within 1e-4, with hits actually taken."""
    results = {}
    for radix in (False, True):
        engine = Engine(_config(models[arch], disable_radix_cache=not radix))
        results[radix] = _run(engine, _mixed_workload())
        assert_all_released(engine)
    on, off = results[True], results[False]
    _assert_same_outputs(on, off)
    assert all(r.cached_prompt_tokens == 0 for r in off)
    hits = [r.cached_prompt_tokens for r in on]
    assert hits[2] >= 40 and hits[3] >= len(on[0].prompt_ids)  # the system prompt; user_a's whole prompt
    assert hits[7] >= 50  # the seeded sample hits the (chunk-cached) long document
    assert sum(r.num_retractions for r in on + off) == 0


def test_multi_turn_continuation_reuses_the_previous_answer(models):
    """Turn 2's prompt is turn 1's prompt + answer + new tokens: all but the answer's last token (never
    computed) come from the cache."""
    outputs = {}
    for radix in (False, True):
        engine = Engine(_config(models["llama"], disable_radix_cache=not radix))
        rng = random.Random(8)
        first = _run(engine, [(0, _tokens(rng, 25), GREEDY)])[0]
        turn2 = first.prompt_ids + first.output_ids + _tokens(rng, 6)
        second = _run(engine, [(0, turn2, GREEDY)])[0]
        outputs[radix] = [first, second]
        if radix:
            assert second.cached_prompt_tokens == 25 + GREEDY.max_new_tokens - 1
        assert_all_released(engine)
    _assert_same_outputs(outputs[True], outputs[False])


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_retraction_under_a_small_pool_matches_the_cache_off_engine(models, arch):
    """A pool far smaller than the workload, no decode reserve: requests are retracted (their KV stays
    cached and the recompute matches it), outputs still equal the cache-off engine's."""
    results = {}
    for radix in (False, True):
        engine = Engine(_config(models[arch], max_total_tokens=160, new_token_reserve_ratio=0.0,
                                disable_radix_cache=not radix))
        results[radix] = _run(engine, _mixed_workload(seed=1))
        assert_all_released(engine)
        assert sum(r.num_retractions for r in results[radix]) > 0, "the pool was sized to force retraction"
    _assert_same_outputs(results[True], results[False])


def test_eviction_under_pressure_never_frees_a_pinned_prefix(models):
    """Finished requests leave the pool full of cached prefixes; new requests sharing one of them need
    room, so the cache evicts (LRU, unlocked leaves only) while their shared prefix stays pinned: after
    every eviction each running request's row still holds the cache's slots for its prefix, no slot
    is owned twice, and the outputs equal the cache-off engine's."""
    rng = random.Random(9)
    shared = _tokens(rng, 48)
    fillers = [(0, _tokens(rng, 30), dataclasses.replace(GREEDY, max_new_tokens=4)) for _ in range(4)]
    later = [(40 + i, shared + _tokens(rng, 10), dataclasses.replace(GREEDY, max_new_tokens=10)) for i in range(3)]
    results, evictions = {}, []
    for radix in (False, True):
        engine = Engine(_config(models["llama"], max_total_tokens=200, new_token_reserve_ratio=0.0,
                                disable_radix_cache=not radix))
        cache = engine.scheduler.cache
        if cache is not None:
            evict = cache.evict

            def checked_evict(n: int, engine=engine, evict=evict) -> int:
                live = [r for r in engine.scheduler.running if r.req_row is not None]
                freed = evict(n)
                evictions.append(freed)
                table = engine.runner.kv.req_table
                for r in live:
                    head = table.slots(r.req_row, r.prefix_len).tolist()
                    assert cached_slots(engine.scheduler.cache, r.fill_ids[: r.prefix_len]) == head
                    free = engine.runner.kv.allocator.free_slots().tolist()
                    assert not set(head) & set(free), "a pinned slot was freed"
                return freed

            cache.evict = checked_evict  # type: ignore[method-assign]
        results[radix] = _run(engine, [(0, shared + _tokens(random.Random(10), 6), GREEDY), *fillers, *later])
        assert_all_released(engine)
    assert sum(evictions) > 0, "the pool was sized so the cache must evict"
    _assert_same_outputs(results[True], results[False])
    assert all(r.cached_prompt_tokens >= 48 for r in results[True][-3:])


# ---- TP = 2 --------------------------------------------------------------------------------------


def test_tp2_followers_get_the_leaders_rows_and_outputs_match_the_cache_off_engine(models):
    """Leader engine (scheduler + LeaderRunner) and a follower's FollowerLoop as threads on a real gloo
    group: after every step the follower's request -> token rows equal the leader's (the cached
    prefixes crossed the step broadcast) and the outputs equal the TP=1 cache-off engine's."""
    arrivals = _mixed_workload(seed=2)
    off = _run(Engine(_config(models["llama"], disable_radix_cache=True)), arrivals)
    config = _config(models["llama"])
    tps = [TPContext(rank=rank, size=2, group=group, store=store)
           for rank, (store, group) in enumerate(gloo_groups(2, "radix"))]
    runners = [RecordingRunner(ModelRunner(config, tp)) for tp in tps]

    def rank_main(rank: int) -> list[Request] | int:
        if rank:
            return FollowerLoop(runners[rank], tps[rank]).run()
        leader = LeaderRunner(runners[0], tps[0])
        engine = Engine(config, runner=leader)
        try:
            reqs = _run(engine, arrivals)
            assert_all_released(engine)
            return reqs
        finally:
            leader.stop_followers()

    on, steps = on_ranks(2, rank_main)
    assert steps == len(runners[0].steps) > 0
    assert runners[1].steps == runners[0].steps
    assert sum(r.cached_prompt_tokens for r in on) > 0
    assert any(r.cached_prompt_tokens for r in on)
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    for a, b in zip(on, off, strict=True):  # fp32 partial sums in another order than TP=1's: a few ulps
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), rtol=0, atol=2e-4)
