"""Two-batch overlap (worker_svc/executor/two_batch.py): the split is a pure, balanced cut between
requests; overlap on gives overlap off's fp32 logits bit for bit (deterministic inference, see below) and
greedy tokens at TP=1 and at TP=2 on shared memory and on gloo, for Llama and DeepSeek-V2 (MLA, MoE),
over chunked prefill with requests sitting steps out and decode; an engine with requests joining and
finishing in mixed steps produces the same tokens; and the collective observer's timestamps prove the
overlap: in every layer A's all-reduce was issued before B's stage began and waited on only after it ended.

TP=2 ranks are threads of this process (tests/ranks.py), each with its own gloo group and its own
mapping of one shared-memory segment.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from llmserve.bench.driver import StaticBatch
from llmserve.modelgen.presets import yarn_rope_scaling
from tests.ranks import gloo_groups, on_ranks, shm_communicators
from tests.unit.oracle import encode_prompts
from worker_svc.config.engine_config import EngineConfig
from worker_svc.engine.engine import Engine
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.executor.two_batch import split_step
from worker_svc.forward_batch import ForwardMode, StepInput
from worker_svc.kernels.row_stable import probe_row_padding
from worker_svc.models.decoder import CausalLM
from worker_svc.parallel import shm_communicator as shm
from worker_svc.parallel.collective_observer import CollectiveRecorder
from worker_svc.parallel.context import TPContext
from worker_svc.sampling import SamplingParams

# A micro-batch's GEMMs have fewer rows than the whole step's. This host's sgemm rounds the rows of a
# partial tile of a small GEMM differently (kernels/row_stable.py), and SDPA rounds a row by the block of
# rows and keys around it, so by default a micro-batch's logits differ from the whole step's: measured
# 1.2e-5..5.5e-5 per step on logits up to 62 (<= 15 fp32 ulps), not growing over 40 steps (bound: the TP
# oracle tests' 1e-4). With --enable-deterministic-inference (row-stable linears, attention row by row)
# they are bit-identical, and these tests assert that (atol 0).
ATOL = 0.0
DEFAULT_MODE_ATOL = 1e-4
COMMS = ["gloo"] + (["shm"] if shm.available() is None else [])


@pytest.fixture(scope="module")
def models(model_factory) -> dict[str, Path]:
    return {"llama": model_factory("tiny"), "deepseek_v2": model_factory("tiny", arch="deepseek_v2")}


def _tp2(comm: str, observer: CollectiveRecorder | None = None) -> list[TPContext]:
    """Two ranks' contexts (threads): a gloo group each, and with "shm" a shared segment's communicators."""
    comms: list[shm.ShmCommunicator] | list[None] = shm_communicators(2) if comm == "shm" else [None, None]
    return [TPContext(rank=rank, size=2, group=group, store=store, comm=comms[rank],
                      observer=observer if rank == 0 else None)
            for rank, (store, group) in enumerate(gloo_groups(2, "tbo"))]


def _runner(model_dir: Path, tp: TPContext, overlap: bool, moe_experts: str = "auto",
            deterministic: bool = True) -> ModelRunner:
    engine = EngineConfig(model_path=str(model_dir), dtype="float32", max_total_tokens=1024, max_running_requests=8,
                          enable_two_batch_overlap=overlap, tbo_min_tokens=2, moe_experts=moe_experts,
                          deterministic_inference=deterministic)
    return ModelRunner(engine, tp)


def _drive(runner: ModelRunner, prompts: list[list[int]], chunk: int = 5, decode_steps: int = 6):
    """Chunked prefill (prompts already done sit later steps out), then greedy decode; returns every
    step's logits and the generated tokens."""
    batch = StaticBatch(runner, len(prompts))
    logits_seen, tokens = [], [[] for _ in prompts]
    try:
        last: list[torch.Tensor | None] = [None] * len(prompts)
        for start in range(0, max(len(p) for p in prompts), chunk):
            live = [i for i, p in enumerate(prompts) if start < len(p)]
            logits = batch.extend([prompts[i][start:start + chunk] for i in live], only=live)
            logits_seen.append(logits)
            for j, i in enumerate(live):
                last[i] = logits[j]
        current = torch.stack([t for t in last if t is not None])
        for _ in range(decode_steps):
            next_ids = current.argmax(dim=-1)
            for i, t in enumerate(next_ids.tolist()):
                tokens[i].append(t)
            current = batch.decode(next_ids)
            logits_seen.append(current)
    finally:
        batch.release()
    return logits_seen, tokens


def _prompts(model_dir: Path) -> list[list[int]]:
    prompts = encode_prompts(model_dir)
    return [prompts[0][:3], *prompts[1:4], prompts[4] * 2]  # uneven lengths: some sit steps out


def _long_prompt(model_dir: Path) -> list[list[int]]:
    """One request alone, prefilled 40 tokens a step: every prefill step is cut inside it."""
    return [[t for p in encode_prompts(model_dir) for t in p][:120]]


def _step(extend: list[int], seq: list[int]) -> StepInput:
    prefix = [s - e for s, e in zip(seq, extend, strict=True)]
    positions = [p for pre, s in zip(prefix, seq, strict=True) for p in range(pre, s)]
    tokens = len(positions)
    return StepInput(
        mode=ForwardMode.EXTEND if max(extend) > 1 else ForwardMode.DECODE,
        input_ids=torch.arange(tokens), positions=torch.tensor(positions), out_slots=torch.arange(tokens),
        req_rows=torch.arange(len(extend)), seq_lens=seq, prefix_lens=prefix,
    )


def _described(split) -> list[tuple]:
    return [(h.req_rows.tolist(), h.input_ids.tolist(), h.seq_lens, h.prefix_lens) for h in (split.first, split.second)]


def test_split_balances_cost_and_cuts_a_long_request_in_two() -> None:
    decode = split_step(_step([1] * 6, [10] * 6), min_tokens=2)
    assert _described(decode) == [([0, 1, 2], [0, 1, 2], [10] * 3, [9] * 3), ([3, 4, 5], [3, 4, 5], [10] * 3, [9] * 3)]
    assert not decode.cut_request
    # A long context weighs its attention: one request with a 40k context balances three short ones.
    skewed = split_step(_step([1] * 4, [40000, 100, 100, 100]), min_tokens=2)
    assert skewed.first.req_rows.tolist() == [0] and skewed.second.seq_lens == [100, 100, 100]
    # One long extend: cut inside it, later tokens (more context each) on the shorter side; B attends to A's part.
    (long,) = [split_step(_step([1000], [1000]), min_tokens=2)]
    assert long.cut_request and long.first.req_rows.tolist() == long.second.req_rows.tolist() == [0]
    head = long.first.input_ids.numel()
    assert 500 < head < 1000 - 1 and long.first.seq_lens == [head] and long.first.prefix_lens == [0]
    assert long.second.prefix_lens == [head] and long.second.seq_lens == [1000]
    assert long.second.positions[0].item() == head
    # Several requests with the cut inside the second: it appears in both halves.
    mixed = split_step(_step([10, 300, 5], [10, 300, 5]), min_tokens=2)
    assert mixed.cut_request and mixed.first.req_rows.tolist() == [0, 1] and mixed.second.req_rows.tolist() == [1, 2]
    assert mixed.first.input_ids.numel() + mixed.second.input_ids.numel() == 315
    assert split_step(_step([1], [5]), min_tokens=2) is None  # one token
    assert split_step(_step([1] * 8, [5] * 8), min_tokens=16) is None  # under --tbo-min-tokens
    assert _described(split_step(_step([40, 9], [90, 9]), 2)) == _described(split_step(_step([40, 9], [90, 9]), 2))


@pytest.mark.parametrize("shape", ["requests", "one_long"])
@pytest.mark.parametrize("name", ["llama", "deepseek_v2"])
def test_overlap_matches_sequential_at_tp1(models, name, shape):
    prompts, chunk = (_prompts(models[name]), 5) if shape == "requests" else (_long_prompt(models[name]), 40)
    off_logits, off_tokens = _drive(_runner(models[name], TPContext(), False), prompts, chunk)
    on_logits, on_tokens = _drive(_runner(models[name], TPContext(), True), prompts, chunk)
    assert on_tokens == off_tokens
    for on, off in zip(on_logits, off_logits, strict=True):
        torch.testing.assert_close(on, off, rtol=0, atol=ATOL)


# The oracle tests' other hidden-size, head and routing variants (test_llama_oracle / test_deepseek_oracle).
VARIANTS = {
    "llama-small": ("small", "llama", {}),
    "llama-head_dim": ("tiny", "llama", {"head_dim": 32}),
    "deepseek_v2-small": ("small", "deepseek_v2", {}),
    "deepseek_v2-yarn_group_limited": ("tiny", "deepseek_v2", {"config_override": {
        "q_lora_rank": 24, "rope_scaling": yarn_rope_scaling(2048, mscale=1.0, mscale_all_dim=0.8),
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 16.0}}),
    "deepseek_v2-moe_only": ("tiny", "deepseek_v2", {"config_override": {
        "first_k_dense_replace": 0, "n_shared_experts": 2, "norm_topk_prob": True}}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_overlap_matches_sequential_across_model_variants(model_factory, variant):
    preset, arch, overrides = VARIANTS[variant]
    model_dir = model_factory(preset, arch=arch, **overrides)
    prompts = _prompts(model_dir) + _long_prompt(model_dir)  # the long one gets cut in prefill
    (off_logits, off_tokens), (on_logits, on_tokens) = (
        _drive(_runner(model_dir, TPContext(), overlap), prompts, chunk=24) for overlap in (False, True))
    assert on_tokens == off_tokens
    for on, off in zip(on_logits, off_logits, strict=True):
        torch.testing.assert_close(on, off, rtol=0, atol=ATOL)


@pytest.mark.parametrize("shape", ["requests", "one_long"])
@pytest.mark.parametrize("name, moe_experts", [("llama", "auto"), ("deepseek_v2", "loop"), ("deepseek_v2", "grouped")])
def test_overlap_in_the_default_mode_stays_within_rounding(models, name, moe_experts, shape):
    """Without deterministic inference (and with the grouped experts, which it does not use): the same
    tokens, logits within the BLAS's row rounding."""
    prompts, chunk = (_prompts(models[name]), 5) if shape == "requests" else (_long_prompt(models[name]), 40)
    runs = [_drive(_runner(models[name], TPContext(), overlap, moe_experts, deterministic=False), prompts, chunk)
            for overlap in (False, True)]
    (off_logits, off_tokens), (on_logits, on_tokens) = runs
    assert on_tokens == off_tokens
    for on, off in zip(on_logits, off_logits, strict=True):
        torch.testing.assert_close(on, off, rtol=0, atol=DEFAULT_MODE_ATOL)


def test_aligned_micro_batches_are_bit_identical(models):
    """Default mode. 8 requests of 4-token chunks, then decode split 4 + 4: every GEMM of a micro-batch has
    a multiple of 4 rows, the BLAS rounds each row as in the whole step, and the split adds no error of its
    own. Where the host's sgemm rounds those row counts differently from a big GEMM (the probe of
    kernels/row_stable.py says), bit identity is what --enable-deterministic-inference gives instead."""
    pad_to = probe_row_padding()
    if pad_to is not None and (odd := [m for m in (4, 8, 16, 32) if pad_to[m] != m]):
        pytest.skip(f"this host's sgemm rounds the rows of {odd}-row GEMMs differently from a 64-row one "
                    "(kernels/row_stable.py probe): the split is bit-identical only with deterministic inference here")
    flat = [t for p in encode_prompts(models["llama"]) for t in p]
    prompts = [flat[i * 12:(i + 1) * 12] for i in range(8)]
    off_logits, off_tokens = _drive(_runner(models["llama"], TPContext(), False, deterministic=False), prompts, 4)
    on_logits, on_tokens = _drive(_runner(models["llama"], TPContext(), True, deterministic=False), prompts, 4)
    assert on_tokens == off_tokens
    for on, off in zip(on_logits, off_logits, strict=True):
        assert torch.equal(on, off), (on - off).abs().max().item()


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("name", ["llama", "deepseek_v2"])
def test_overlap_matches_sequential_at_tp2(models, name, comm):
    prompts = _prompts(models[name]) + _long_prompt(models[name])  # the long one gets cut in prefill
    results = {}
    for overlap in (False, True):
        tps = _tp2(comm)
        runners = [_runner(models[name], tp, overlap) for tp in tps]
        results[overlap] = on_ranks(2, lambda rank, runners=runners: _drive(runners[rank], prompts, chunk=40))
    for rank in range(2):
        (off_logits, off_tokens), (on_logits, on_tokens) = results[False][rank], results[True][rank]
        assert on_tokens == off_tokens
        for on, off in zip(on_logits, off_logits, strict=True):
            torch.testing.assert_close(on, off, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["llama", "deepseek_v2"])
def test_engine_with_requests_joining_and_finishing_gives_the_same_tokens(models, name):
    """Mixed steps (chunked prefill beside decodes), two running at a time so requests join as others
    finish, different lengths: the same greedy tokens with overlap on."""
    prompts = encode_prompts(models[name])[:5]
    params = [SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    outputs = {}
    for overlap in (False, True):
        config = EngineConfig(model_path=str(models[name]), dtype="float32", max_total_tokens=1024,
                              max_running_requests=3, chunked_prefill_size=8, max_prefill_tokens=8,
                              enable_two_batch_overlap=overlap, tbo_min_tokens=2, deterministic_inference=True)
        outputs[overlap] = [r.output_ids for r in Engine(config).generate(prompts, params)]
    assert outputs[True] == outputs[False]
    assert [len(o) for o in outputs[True]] == [4 + 3 * i for i in range(len(prompts))]


def test_observer_timestamps_prove_the_overlap(models):
    """Every layer of a TP=2 decode step: A's all-reduce (attention and MLP) was issued before B's
    stage began and waited on only after B's stage ended."""
    comm = COMMS[-1]
    recorder = CollectiveRecorder()
    tps = _tp2(comm, observer=recorder)
    runners = [_runner(models["llama"], tp, True) for tp in tps]
    lm = runners[0].model
    assert isinstance(lm, CausalLM)
    stages: list[tuple[str, int, int]] = []  # (stage, start_ns, end_ns) on rank 0, in call order
    starts: dict[str, int] = {}

    def timed(kind: str):
        def pre(module, args):
            starts[kind] = time.perf_counter_ns()

        def post(module, args, out):
            stages.append((kind, starts.pop(kind), time.perf_counter_ns()))

        return pre, post

    for layer in lm.model.decoder_layers():
        for kind, module in (("attention", layer.self_attn), ("mlp", layer.mlp)):
            pre, post = timed(kind)
            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post)
    prompts = [p[:6] for p in encode_prompts(models["llama"])[:4]]

    def one_decode_step(rank: int) -> None:
        batch = StaticBatch(runners[rank], len(prompts))
        try:
            logits = batch.extend(prompts)
            if rank == 0:
                recorder.clear()
                stages.clear()
            batch.decode(logits.argmax(dim=-1))
        finally:
            batch.release()

    on_ranks(2, one_decode_step)
    layers = len(lm.model.decoder_layers())
    reduces = [r for r in recorder.records if r.op == "all_reduce" and r.async_op]
    reduces.sort(key=lambda r: r.issue_ns)
    assert len(reduces) == 4 * layers and len(stages) == 4 * layers
    for i in range(layers):
        a_attn, b_attn, a_mlp, b_mlp = reduces[4 * i: 4 * i + 4]
        (k1, _, _), (k2, b_attn_start, b_attn_end), (k3, _, _), (k4, b_mlp_start, b_mlp_end) = stages[4 * i: 4 * i + 4]
        assert (k1, k2, k3, k4) == ("attention", "attention", "mlp", "mlp")
        assert a_attn.issue_ns < b_attn_start and a_attn.wait_ns >= b_attn_end, f"layer {i} attention"
        assert a_mlp.issue_ns < b_mlp_start and a_mlp.wait_ns >= b_mlp_end, f"layer {i} mlp"
        assert b_attn.issue_ns >= b_attn_end and b_mlp.issue_ns >= b_mlp_end


def test_flags_reach_the_engine_config() -> None:
    import argparse

    from llmserve.commands.engine_args import add_engine_args, engine_argv, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "m", "--enable-two-batch-overlap", "--tbo-min-tokens", "64"])
    config = engine_config_from_args(args)
    assert config.enable_two_batch_overlap and config.tbo_min_tokens == 64
    assert "--enable-two-batch-overlap" in engine_argv(args) and "64" in engine_argv(args)  # to followers too
    with pytest.raises(ValueError, match="tbo-min-tokens"):
        dataclasses.replace(config, tbo_min_tokens=1)


@pytest.mark.parametrize("name", ["llama", "deepseek_v2"])
def test_every_position_logits_of_a_cut_request(models, name):
    """Teacher-forced scoring (logits at every token, eval-ppl) of one request cut in two: A's rows
    then B's, one per token, as without the split."""
    (prompt,) = _long_prompt(models[name])
    rows = []
    for overlap in (False, True):
        batch = StaticBatch(_runner(models[name], TPContext(), overlap), 1)
        try:
            rows.append(batch.extend([prompt[:90]], all_logits=True))
        finally:
            batch.release()
    assert rows[0].shape == rows[1].shape == (90, rows[0].shape[-1])
    torch.testing.assert_close(rows[1], rows[0], rtol=0, atol=ATOL)
