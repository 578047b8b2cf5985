"""Scheduler and engine behaviour on the tiny generated model (fp32, small KV pools): KV accounting
under finish/abort/retraction, request validation, abort, stop conditions, sampling through the
engine, batch limits, chunked prefill and concurrent submission."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time

import pytest
import torch

from llmserve.bench.driver import StaticBatch
from tests.unit.kv_invariants import assert_all_released, assert_kv_consistent
from worker_svc.config.engine_config import EngineConfig
from worker_svc.engine.engine import Engine
from worker_svc.engine.request import FinishReason, RequestError
from worker_svc.engine.scheduler import Scheduler
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.forward_batch import ForwardMode, StepInput
from worker_svc.sampling import SamplingParams

VOCAB = 512  # the tiny preset
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
# The random tiny model's logits are very peaked (std ~14): at T=1 most draws are the argmax. A hot
# temperature makes draws from different seeds diverge within a few tokens.
HOT = dataclasses.replace(SAMPLED, temperature=5.0)



def _config(model_dir, **kw) -> EngineConfig:
    """Tests that step the scheduler by hand and expect given requests in given steps pass
    ``prefill_batching="budget"``: under "cost" the split of a burst follows the measured step times."""
    base = dict(
        model_path=str(model_dir),
        dtype="float32",
        max_total_tokens=512,
        max_running_requests=4,
        chunked_prefill_size=16,
        max_prefill_tokens=32,
        context_length=256,
    )
    base.update(kw)
    return EngineConfig(**base)


def _engine(model_dir, **kw) -> Engine:
    return Engine(_config(model_dir, **kw))


def _prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _alone(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens a request gets when it is the only one on the engine."""
    assert not engine.scheduler.has_work()
    (result,) = engine.generate([prompt], params)
    return result.output_ids


def _first_new_token_index(tokens: list[int], start: int = 2) -> int:
    """An index k >= start whose token does not occur earlier in ``tokens`` (so stopping on it is
    unambiguous)."""
    for k in range(start, len(tokens)):
        if tokens[k] not in tokens[:k]:
            return k
    raise AssertionError(f"no fresh token in {tokens}")


def _assert_kv_consistent(engine: Engine) -> None:
    """Slots of live requests, the radix cache and the allocator's free list partition 1..size exactly;
    request rows of live requests are distinct and, with the free rows, account for every row."""
    assert_kv_consistent(engine)


def _assert_all_released(engine: Engine) -> None:
    """Nothing in flight, nothing pinned; after FlushCache every slot is free again."""
    assert_all_released(engine)


def _step_checked(engine: Engine) -> list:
    outputs = engine.scheduler.step()
    _assert_kv_consistent(engine)
    return outputs


# ---- KV accounting -------------------------------------------------------------------------------


def test_kv_accounting_through_finish_abort_and_retraction(tiny_model):
    """Abort while waiting, while decoding and mid chunked prefill, with retraction forced by a small
    pool and no decode reserve: the pool and request table are whole again at the end, no slot is
    ever owned twice, and the survivors produce the tokens they produce alone."""
    engine = _engine(tiny_model, max_total_tokens=96, new_token_reserve_ratio=0.0, prefill_batching="budget")
    sched = engine.scheduler
    prompts = _prompts((10, 40, 14, 36, 8, 12, 9, 45))
    # Greedy and seeded sampled requests: a recomputed request must continue its own random stream.
    params = [dataclasses.replace(GREEDY if i % 2 else dataclasses.replace(HOT, seed=i), max_new_tokens=24)
              for i in range(len(prompts))]
    expected = [_alone(engine, p, q) for p, q in zip(prompts, params, strict=False)]
    _assert_all_released(engine)

    reqs = [engine.submit(p, q) for p, q in zip(prompts, params, strict=False)]
    waiting_victim, chunk_victim, decode_victim = reqs[7], reqs[1], reqs[0]
    outputs: dict[str, list] = {r.rid: [] for r in reqs}

    def step():
        for out in _step_checked(engine):
            outputs[out.rid].append(out)

    step()
    assert waiting_victim in sched.waiting
    assert sched.chunked is chunk_victim and 0 < chunk_victim.num_cached < len(prompts[1])
    engine.scheduler.abort(waiting_victim.rid)
    engine.scheduler.abort(chunk_victim.rid)
    step()
    while len(decode_victim.output_ids) < 3:
        step()
    assert decode_victim in sched.running
    engine.scheduler.abort(decode_victim.rid)
    for _ in range(1000):
        if not sched.has_work():
            break
        step()
    _assert_all_released(engine)

    for victim in (waiting_victim, chunk_victim, decode_victim):
        assert victim.finish_reason is FinishReason.ABORT
        assert outputs[victim.rid][-1].finish_reason is FinishReason.ABORT
    assert waiting_victim.output_ids == [] and chunk_victim.output_ids == []
    assert decode_victim.output_ids == expected[0][: len(decode_victim.output_ids)]
    survivors = [i for i in range(len(reqs)) if reqs[i] not in (waiting_victim, chunk_victim, decode_victim)]
    assert sum(reqs[i].num_retractions for i in survivors) > 0, "the pool was sized to force retraction"
    assert any(reqs[i].num_retractions and not params[i].is_greedy for i in survivors)
    for i in survivors:
        assert reqs[i].finish_reason is FinishReason.LENGTH
        assert reqs[i].output_ids == expected[i], f"request {i} changed by batching/retraction"
        streamed = [t for out in outputs[reqs[i].rid] for t in out.new_token_ids]
        assert streamed == expected[i], "each token is streamed exactly once, retraction included"


def test_kv_accounting_random_workload(tiny_model):
    """Seeded random arrivals, aborts and stop tokens on a tight pool; invariants after every step."""
    engine = _engine(tiny_model, max_total_tokens=80, max_running_requests=3, chunked_prefill_size=8,
                     max_prefill_tokens=12, new_token_reserve_ratio=0.1)
    sched = engine.scheduler
    rng = random.Random(7)
    live, finished = [], []
    aborted_while = set()
    for step_no in range(400):
        if step_no < 150 and rng.random() < 0.3:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(
                max_new_tokens=rng.randint(1, 20),
                temperature=rng.choice([0.0, 0.8]),
                seed=rng.randrange(1000),
                stop_token_ids=tuple(rng.sample(range(VOCAB), 3)),
            )
            live.append(engine.submit(prompt, params))
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            if victim in sched.waiting:
                aborted_while.add("waiting")
            elif victim is sched.chunked:
                aborted_while.add("chunked")
            elif victim in sched.running:
                aborted_while.add("running")
            sched.abort(victim.rid)
        for out in _step_checked(engine):
            if out.finished:
                req = next(r for r in live if r.rid == out.rid)
                live.remove(req)
                finished.append(req)
        assert len(sched.running) + (sched.chunked is not None) <= engine.config.max_running_requests
        if step_no >= 150 and not sched.has_work():
            break
    _assert_all_released(engine)
    assert not live
    reasons = {r.finish_reason for r in finished}
    assert reasons == {FinishReason.ABORT, FinishReason.STOP, FinishReason.LENGTH}, reasons
    assert {"waiting", "running"} <= aborted_while, aborted_while
    assert sum(r.num_retractions for r in finished) > 0


@pytest.mark.parametrize("radix", [False, True], ids=["no_cache", "radix_cache"])
def test_retracting_a_chunked_prefill(tiny_model, radix):
    """A long prompt being chunk-prefilled next to one decoding request runs the pool dry: the
    part-prefilled prompt is the one retracted, and both still produce their solo tokens. Without the
    prefix cache it waits for the pool; with it, its computed chunks stay cached and it comes back as
    soon as the rest fits (possibly retracted again)."""
    engine = _engine(tiny_model, max_total_tokens=64, new_token_reserve_ratio=0.0, chunked_prefill_size=8,
                     max_prefill_tokens=8, disable_radix_cache=not radix)
    sched = engine.scheduler
    short_prompt, long_prompt = _prompts((10, 44), seed=12)
    short_params = dataclasses.replace(GREEDY, max_new_tokens=50)
    long_params = dataclasses.replace(GREEDY, max_new_tokens=2)
    expected = [_alone(engine, short_prompt, short_params), _alone(engine, long_prompt, long_params)]
    assert engine.flush_cache()[0]  # the solo runs' prompts would be cache hits: no chunked prefill at all
    short = engine.submit(short_prompt, short_params)
    for _ in range(8):
        _step_checked(engine)
    long = engine.submit(long_prompt, long_params)
    retracted_mid_prefill = 0
    while sched.has_work():
        was_chunked = sched.chunked is long
        _step_checked(engine)
        if was_chunked and long in sched.waiting:
            retracted_mid_prefill += 1
            assert short in sched.running, "the chunked prompt, not the decoding request, gives way"
    assert (retracted_mid_prefill >= 1 if radix else retracted_mid_prefill == 1) and short.num_retractions == 0
    assert [short.output_ids, long.output_ids] == expected
    _assert_all_released(engine)


def test_failed_forward_fails_only_its_batch(tiny_model):
    engine = _engine(tiny_model, max_running_requests=2, prefill_batching="budget")
    sched = engine.scheduler
    prompts = _prompts((5, 9, 7), seed=11)
    expected = _alone(engine, prompts[2], GREEDY)
    reqs = [engine.submit(p, GREEDY) for p in prompts]
    forward, calls = engine.runner.forward, []

    def flaky_forward(step: StepInput):
        calls.append(step.mode)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return forward(step)

    engine.runner.forward = flaky_forward
    _step_checked(engine)
    assert reqs[2] in sched.waiting and len(reqs[0].output_ids) == 1
    outs = _step_checked(engine)  # the decode step of requests 0 and 1 fails
    assert calls == [ForwardMode.EXTEND, ForwardMode.DECODE]
    assert {o.rid for o in outs} == {reqs[0].rid, reqs[1].rid}
    assert all(o.finish_reason is FinishReason.ABORT and "boom" in o.error for o in outs)
    assert sched.last_step is None  # nothing computed: no step-trace line, no step time for the cost model
    while sched.has_work():
        _step_checked(engine)
    assert reqs[2].output_ids == expected and reqs[2].error is None
    _assert_all_released(engine)


# ---- validation ----------------------------------------------------------------------------------


def test_request_that_can_never_fit_is_a_resource_error(tiny_model):
    # limit = min(context 64, pool 512) = 64 tokens.
    engine = _engine(tiny_model, context_length=64)
    with pytest.raises(RequestError) as info:
        engine.submit([1] * 40, SamplingParams(max_new_tokens=25))
    assert info.value.resource is True and info.value.field == "max_new_tokens"
    assert "max_new_tokens" in str(info.value)
    with pytest.raises(RequestError) as info:
        engine.submit([1] * 64, SamplingParams(max_new_tokens=1))
    assert info.value.resource is True and info.value.field == "input_ids"
    # Exactly at the limit is accepted.
    engine.submit([1] * 40, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    engine.run_until_idle()

    # limit = min(context 256, pool 48) = 48: the KV pool is the binding constraint.
    small = _engine(tiny_model, max_total_tokens=48)
    with pytest.raises(RequestError) as info:
        small.submit([1] * 30, SamplingParams(max_new_tokens=19))
    assert info.value.resource is True and "KV pool 48" in str(info.value)
    assert not small.scheduler.has_work()


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], GREEDY, "input_ids"),
        ([3, VOCAB, 4], GREEDY, "input_ids"),
        ([3, -1, 4], GREEDY, "input_ids"),
        ([3, 4], dataclasses.replace(GREEDY, temperature=-0.5), "temperature"),
        ([3, 4], dataclasses.replace(GREEDY, temperature=float("nan")), "temperature"),
        ([3, 4], dataclasses.replace(GREEDY, top_p=1.5), "top_p"),
        ([3, 4], dataclasses.replace(GREEDY, top_k=-2), "top_k"),
        ([3, 4], dataclasses.replace(GREEDY, max_new_tokens=0), "max_new_tokens"),
        ([3, 4], dataclasses.replace(GREEDY, min_new_tokens=17), "min_new_tokens"),
        ([3, 4], dataclasses.replace(GREEDY, stop_token_ids=(5, VOCAB)), "stop_token_ids"),
        ([3, 4], dataclasses.replace(GREEDY, n=0), "n"),
        ([3, 4], dataclasses.replace(GREEDY, top_logprobs_num=21), "top_logprobs_num"),
    ],
)
def test_invalid_request_names_the_field(tiny_model, prompt, params, field):
    engine = _engine(tiny_model)
    with pytest.raises(RequestError) as info:
        engine.submit(prompt, params)
    assert info.value.field == field
    assert field in str(info.value)
    assert info.value.resource is False
    assert not engine.scheduler.has_work()


def test_rejected_requests_do_not_disturb_others(tiny_model):
    engine = _engine(tiny_model, context_length=64)
    prompts = _prompts((7, 20))
    expected = [_alone(engine, p, GREEDY) for p in prompts]
    good = [engine.submit(prompts[0], GREEDY)]
    for bad_prompt, bad_params in (
        ([1] * 60, GREEDY),  # can never fit
        ([VOCAB + 3], GREEDY),
        ([1, 2], dataclasses.replace(GREEDY, top_p=0.0)),
    ):
        with pytest.raises(RequestError):
            engine.submit(bad_prompt, bad_params)
    engine.scheduler.step()
    good.append(engine.submit(prompts[1], GREEDY))
    engine.run_until_idle()
    assert [r.output_ids for r in good] == expected
    _assert_all_released(engine)


# ---- abort ---------------------------------------------------------------------------------------


def test_abort_waiting_and_running(tiny_model):
    engine = _engine(tiny_model, max_running_requests=2, prefill_batching="budget")
    sched = engine.scheduler
    prompts = _prompts((6, 9, 12, 5), seed=1)
    expected = [_alone(engine, p, GREEDY) for p in prompts]
    reqs = [engine.submit(p, GREEDY) for p in prompts]
    outs: list = []
    outs += sched.step()
    outs += sched.step()
    running_victim, waiting_victim = reqs[1], reqs[3]
    assert running_victim in sched.running and len(running_victim.output_ids) == 2
    assert waiting_victim in sched.waiting
    sched.abort(running_victim.rid)
    sched.abort(waiting_victim.rid)
    sched.abort("no-such-request")  # ignored
    step_outs = sched.step()
    aborts = {o.rid: o for o in step_outs if o.finish_reason is FinishReason.ABORT}
    assert set(aborts) == {running_victim.rid, waiting_victim.rid}
    assert aborts[running_victim.rid].new_token_ids == []
    assert aborts[running_victim.rid].completion_tokens == 2
    assert aborts[waiting_victim.rid].completion_tokens == 0
    assert aborts[waiting_victim.rid].prompt_tokens == len(prompts[3])
    engine.run_until_idle()
    assert running_victim.output_ids == expected[1][:2]
    assert reqs[0].output_ids == expected[0] and reqs[2].output_ids == expected[2]
    assert reqs[0].finish_reason is reqs[2].finish_reason is FinishReason.LENGTH
    # Aborting a finished request is a no-op: no output, nothing freed twice.
    sched.abort(reqs[0].rid)
    assert sched.step() == []
    _assert_all_released(engine)


# ---- stop conditions -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stop_case(tiny_model):
    engine = _engine(tiny_model)
    prompt = _prompts((11,), seed=2)[0]
    params = dataclasses.replace(GREEDY, max_new_tokens=24)
    ref = _alone(engine, prompt, params)
    k = _first_new_token_index(ref, start=3)
    return engine, prompt, params, ref, k


def test_stop_token_ids_stop_exactly_there(stop_case):
    engine, prompt, params, ref, k = stop_case
    stop = ref[k]
    assert VOCAB - 1 not in ref  # a second stop id that never comes up
    (res,) = engine.generate([prompt], dataclasses.replace(params, stop_token_ids=(VOCAB - 1, stop)))
    assert res.output_ids == ref[: k + 1]
    assert res.finish_reason is FinishReason.STOP and res.matched_stop == stop


def test_eos_stops_unless_ignored(stop_case):
    engine, prompt, params, ref, k = stop_case
    eos = ref[k]
    custom = Engine(engine.config)
    custom.scheduler = Scheduler(
        custom.runner, custom.runner.kv, custom.runner.engine_config, eos_token_ids=frozenset({eos})
    )
    (res,) = custom.generate([prompt], dataclasses.replace(params, ignore_eos=False))
    assert res.output_ids == ref[: k + 1]
    assert res.finish_reason is FinishReason.STOP and res.matched_stop == eos
    (res,) = custom.generate([prompt], params)  # ignore_eos=True
    assert res.output_ids == ref and res.finish_reason is FinishReason.LENGTH and res.matched_stop is None
    # min_new_tokens masks EOS too.
    (res,) = custom.generate([prompt], dataclasses.replace(params, ignore_eos=False, min_new_tokens=k + 1))
    assert res.output_ids[:k] == ref[:k] and eos not in res.output_ids[: k + 1]


def test_default_eos_is_config_plus_generation_config(stop_case, tiny_model):
    engine = stop_case[0]
    eos = json.loads((tiny_model / "config.json").read_text())["eos_token_id"]
    generation_eos = json.loads((tiny_model / "generation_config.json").read_text())["eos_token_id"]
    assert eos in generation_eos and len(generation_eos) == 2  # <|end_of_text|>, <|eot_id|>
    assert engine.scheduler.eos_token_ids == frozenset(generation_eos)


def test_min_new_tokens(stop_case):
    engine, prompt, params, ref, k = stop_case
    stop = ref[k]
    # min_new_tokens=m: at least m tokens before a stop token (HF/vLLM semantics), so with m == k the
    # stop token at index k still ends the request ...
    (res,) = engine.generate([prompt], dataclasses.replace(params, stop_token_ids=(stop,), min_new_tokens=k))
    assert res.output_ids == ref[: k + 1] and res.finish_reason is FinishReason.STOP and res.matched_stop == stop
    # ... but with m == k + 1 it is masked at index k, so decoding takes another path there.
    m = k + 1
    (res,) = engine.generate([prompt], dataclasses.replace(params, stop_token_ids=(stop,), min_new_tokens=m))
    assert res.output_ids[:k] == ref[:k]
    assert res.output_ids[k] != stop
    assert len(res.output_ids) > m
    assert stop not in res.output_ids[:m]
    if res.finish_reason is FinishReason.STOP:
        assert res.output_ids[-1] == stop == res.matched_stop
    else:
        assert res.finish_reason is FinishReason.LENGTH and len(res.output_ids) == params.max_new_tokens


def test_max_new_tokens_is_length(stop_case):
    engine, prompt, params, ref, _ = stop_case
    for n in (1, 5):
        (res,) = engine.generate([prompt], dataclasses.replace(params, max_new_tokens=n))
        assert res.output_ids == ref[:n]
        assert res.finish_reason is FinishReason.LENGTH and res.matched_stop is None


# ---- sampling through the engine -----------------------------------------------------------------


@pytest.mark.parametrize("sampled", [SAMPLED, HOT], ids=["T1", "T5"])
def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny_model, sampled):
    engine = _engine(tiny_model)
    prompt, *others = _prompts((9, 14, 30, 6), seed=3)
    first = _alone(engine, prompt, sampled)
    assert _alone(engine, prompt, sampled) == first
    greedy = _alone(engine, prompt, GREEDY)
    assert first != greedy, "the seeded draws should leave the argmax path somewhere"
    # In a batch, arriving while others are mid-prefill / decoding, with other sampled rows around.
    reqs = [engine.submit(others[0], dataclasses.replace(SAMPLED, seed=1)),
            engine.submit(others[1], GREEDY)]
    engine.scheduler.step()
    engine.scheduler.step()
    target = engine.submit(prompt, sampled)
    reqs.append(engine.submit(others[2], dataclasses.replace(HOT, seed=2, top_k=20)))
    engine.run_until_idle()
    assert target.output_ids == first
    assert all(len(r.output_ids) == GREEDY.max_new_tokens for r in reqs)


def test_different_seeds_give_different_sequences(tiny_model):
    engine = _engine(tiny_model)
    prompt = _prompts((9,), seed=3)[0]
    runs = {seed: tuple(_alone(engine, prompt, dataclasses.replace(HOT, seed=seed))) for seed in (1, 2, 3, 4)}
    assert len(set(runs.values())) == 4, runs


def test_top_k_1_equals_greedy(tiny_model):
    engine = _engine(tiny_model)
    prompt = _prompts((13,), seed=4)[0]
    greedy = _alone(engine, prompt, GREEDY)
    assert _alone(engine, prompt, HOT) != greedy
    top1 = _alone(engine, prompt, dataclasses.replace(HOT, top_k=1))
    assert top1 == greedy


def test_n_gives_n_results_per_prompt(tiny_model):
    engine = _engine(tiny_model)
    prompts = _prompts((5, 8), seed=5)
    results = engine.generate(prompts, dataclasses.replace(HOT, n=2, max_new_tokens=6))
    assert len(results) == 4
    assert [r.prompt_ids for r in results] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert len({r.rid for r in results}) == 4
    assert all(len(r.output_ids) == 6 for r in results)
    # n samples of one prompt are independent draws, even with a seed ...
    assert results[0].output_ids != results[1].output_ids
    assert results[2].output_ids != results[3].output_ids
    # ... and the whole set is reproducible from that seed.
    again = engine.generate(prompts, dataclasses.replace(HOT, n=2, max_new_tokens=6))
    assert [r.output_ids for r in again] == [r.output_ids for r in results]
    _assert_all_released(engine)


def _teacher_forced_logits(model_dir, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] logits the model gives before each of ``tokens`` (runner driven directly)."""
    runner = ModelRunner(_config(model_dir))
    batch = StaticBatch(runner, 1)
    rows = [batch.extend([prompt])[0]]
    for tok in tokens[:-1]:
        rows.append(batch.decode(torch.tensor([tok]))[0])
    batch.release()
    return torch.stack(rows)


def _expected_logprobs(model_dir, prompt, tokens, temperature=1.0) -> torch.Tensor:
    logits = _teacher_forced_logits(model_dir, prompt, tokens)
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_logprobs_match_log_softmax_of_the_logits(tiny_model):
    engine = _engine(tiny_model)
    prompt = _prompts((10,), seed=6)[0]
    (greedy,) = engine.generate([prompt], dataclasses.replace(GREEDY, return_logprob=True))
    assert len(greedy.logprobs) == len(greedy.output_ids) == GREEDY.max_new_tokens
    assert all(lp <= 0 for lp in greedy.logprobs)
    logits = _teacher_forced_logits(tiny_model, prompt, greedy.output_ids)
    assert logits.argmax(-1).tolist() == greedy.output_ids
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(greedy.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(greedy.logprobs), expected, atol=1e-4, rtol=0)
    assert len(set(greedy.logprobs)) > 1, "a constant would not be a logprob per step"

    # Without return_logprob nothing is reported.
    (plain,) = engine.generate([prompt], GREEDY)
    assert plain.logprobs == [] and plain.output_ids == greedy.output_ids


def test_logprobs_in_a_mixed_batch(tiny_model):
    """Rows that ask for logprobs get their own row's values, whatever else is in the batch; for a
    sampled row that is log_softmax(logits / T) at the chosen token (before top-p truncation)."""
    engine = _engine(tiny_model)
    prompts = _prompts((7, 10, 13), seed=6)
    params = [
        GREEDY,  # no logprobs
        dataclasses.replace(GREEDY, return_logprob=True),
        dataclasses.replace(HOT, temperature=2.0, return_logprob=True),
    ]
    results = engine.generate(prompts, params)
    assert results[0].logprobs == []
    for result, prompt, p in zip(results[1:], prompts[1:], params[1:], strict=False):
        assert len(result.logprobs) == len(result.output_ids) == p.max_new_tokens
        assert all(lp <= 0 for lp in result.logprobs)
        expected = _expected_logprobs(tiny_model, prompt, result.output_ids, p.temperature or 1.0)
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)


# ---- batch limits and chunked prefill ------------------------------------------------------------


def test_max_running_requests_and_chunked_prefill_size(tiny_model):
    limit, chunk = 3, 8
    engine = _engine(tiny_model, max_running_requests=limit, chunked_prefill_size=chunk, max_prefill_tokens=20)
    sched = engine.scheduler
    prompts = _prompts((3, 4, 5, 30, 12, 7, 21, 3, 17), seed=8)
    expected = [_alone(engine, p, GREEDY) for p in prompts]
    assert engine.flush_cache()[0]  # or the solo runs' prompts are cache hits and nothing is chunked
    reqs = [engine.submit(p, GREEDY) for p in prompts]
    steps: list[StepInput] = []
    long_req, long_pieces = reqs[3], []  # the 30-token prompt; (prefix, seq) of its prefill steps
    forward = engine.runner.forward

    def recording_forward(step: StepInput):
        # Each row's tokens are exactly the owning request's next uncached tokens, at their positions.
        offset = 0
        for row, prefix, seq in zip(step.req_rows.tolist(), step.prefix_lens, step.seq_lens, strict=False):
            (req,) = [r for r in reqs if r.req_row == row]
            assert prefix == req.num_cached
            assert step.input_ids[offset : offset + seq - prefix].tolist() == req.fill_ids[prefix:seq]
            assert step.positions[offset : offset + seq - prefix].tolist() == list(range(prefix, seq))
            if req is long_req and prefix < len(long_req.prompt_ids):
                long_pieces.append((prefix, seq))
            offset += seq - prefix
        assert offset == step.input_ids.numel() == step.out_slots.numel()
        steps.append(step)
        return forward(step)

    engine.runner.forward = recording_forward
    max_live = 0
    while sched.has_work():
        sched.step()
        live = len(sched.running) + (sched.chunked is not None)
        assert live <= limit
        max_live = max(max_live, live)
    assert max_live == limit
    assert [r.output_ids for r in reqs] == expected
    for step in steps:
        assert len(step.seq_lens) <= limit
        ext = [s - p for s, p in zip(step.seq_lens, step.prefix_lens, strict=False)]
        assert max(ext) <= chunk, ext
        if step.mode is ForwardMode.DECODE:
            assert ext == [1] * len(ext)
    # The 30-token prompt was prefilled in consecutive chunks of at most `chunk` tokens.
    assert len(long_pieces) >= 4, long_pieces
    assert long_pieces[0][0] == 0 and long_pieces[-1][1] == len(long_req.prompt_ids)
    assert all(a[1] == b[0] for a, b in zip(long_pieces, long_pieces[1:], strict=False)), long_pieces
    assert any(s.mode is ForwardMode.DECODE for s in steps)
    _assert_all_released(engine)


# ---- threads -------------------------------------------------------------------------------------


def test_submit_from_threads_while_stepping(tiny_model):
    engine = _engine(tiny_model, max_running_requests=4)
    prompts = _prompts((4, 7, 11, 6, 9, 13, 5, 8), seed=9)
    params = dataclasses.replace(GREEDY, max_new_tokens=6)
    expected = {tuple(p): _alone(engine, p, params) for p in prompts}
    submitted: list = []
    lock = threading.Lock()

    def client(part: list[list[int]]):
        for p in part:
            req = engine.submit(p, params)
            with lock:
                submitted.append(req)
            time.sleep(0.002)

    threads = [threading.Thread(target=client, args=(prompts[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while any(t.is_alive() for t in threads) or engine.scheduler.has_work():
        assert time.monotonic() < deadline, "engine did not drain"
        engine.scheduler.step()
        _assert_kv_consistent(engine)
    for t in threads:
        t.join()
    assert len(submitted) == len(prompts)
    for req in submitted:
        assert req.finish_reason is FinishReason.LENGTH
        assert req.output_ids == expected[tuple(req.prompt_ids)]
    _assert_all_released(engine)


def test_a_requests_tokens_slice_its_prompt_and_output_as_fill_ids_does():
    from worker_svc.engine.request import Request

    req = Request(rid="r", prompt_ids=[1, 2, 3, 4], params=SamplingParams(), noise_key=0)
    req.output_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 8):
            assert req.tokens(start, end) == req.fill_ids[start:end], (start, end)
