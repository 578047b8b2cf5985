"""CUDA graphs for decode (worker_svc/executor/cuda_graph_runner.py), as far as the CPU can check them:
the captured sizes and context buckets and which one a step maps to; padding rows (token 0, row 0,
length 1) write only KV slot 0; the fixed-shape decode attention a graph captures
(a context bucket past every request, the length mask always on, padding rows) equals the eager decode
attention for MHA (grouped matmul, SDPA, the AVX2 kernel) and MLA (absorbed, normal); the whole static-buffer
forward, run eagerly (what a graph would hold, without the capture), gives the eager decode's logits
over many steps with requests joining and finishing, steps that fit no graph run eagerly, and none of
its ops reads from the host (what a capture forbids); the
flags reach the EngineConfig; graphs resolve off on the CPU (and where a step cannot be captured)
and no runner is built. The capture and replay themselves need CUDA: those tests skip without it."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.ranks import gloo_groups
from tests.unit.oracle import encode_prompts
from tests.unit.test_moe_experts import HOST_SYNC_OPS, OpRecorder
from worker_svc.attention.base import AttentionLayer, MLAAttentionLayer
from worker_svc.attention.torch_native import TorchNativeAttentionBackend
from worker_svc.attention.torch_native_mla import TorchNativeMLABackend
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.cuda_graph_runner import (
    CudaGraphRunner,
    capture_batch_sizes,
    context_buckets,
    fit,
    graph_plan,
    pad_decode,
)
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.forward_batch import ForwardBatch, ForwardMode, StepInput
from worker_svc.kernels import cpu_ext
from worker_svc.kvcache import MHAKVPool, MLAKVPool
from worker_svc.parallel.context import TPContext

CPU_OPS = cpu_ext.load()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing CUDA graphs needs a CUDA device")
CUDA = torch.device("cuda")  # a device object only: graph_plan reads its type, nothing runs there


# ---- sizes, buckets, padding ----------------------------------------------------------------------


def test_captured_batch_sizes_follow_sglangs_list() -> None:
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]  # the largest itself is always captured
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(1) == [1]
    with pytest.raises(ValueError, match="positive"):
        capture_batch_sizes(0)


def test_context_buckets_double_up_to_the_longest_context() -> None:
    assert context_buckets(2048) == [256, 512, 1024, 2048]
    assert context_buckets(1000) == [256, 512, 1000]
    assert context_buckets(100) == [100]
    assert context_buckets(64, smallest=16) == [16, 32, 64]


def test_a_batch_maps_to_the_next_captured_size() -> None:
    sizes = [1, 2, 4, 8, 16, 24]
    assert [fit(n, sizes) for n in (1, 2, 3, 4, 5, 9, 17, 24)] == [1, 2, 4, 4, 8, 16, 24, 24]
    assert fit(25, sizes) is None


def _decode_step(tokens: list[int], positions: list[int], slots: list[int], rows: list[int]) -> StepInput:
    return StepInput(
        mode=ForwardMode.DECODE, input_ids=torch.tensor(tokens), positions=torch.tensor(positions),
        out_slots=torch.tensor(slots), req_rows=torch.tensor(rows), seq_lens=[p + 1 for p in positions],
        prefix_lens=list(positions),
    )


def test_padding_rows_are_token_0_of_row_0_writing_slot_0() -> None:
    step = _decode_step([7, 8, 9], [4, 10, 2], [31, 32, 33], [5, 2, 6])
    padded = pad_decode(step, 8)
    assert padded.input_ids.tolist() == [7, 8, 9] + [0] * 5
    assert padded.positions.tolist() == [4, 10, 2] + [0] * 5
    assert padded.out_slots.tolist() == [31, 32, 33] + [0] * 5  # slot 0: the allocator never hands it out
    assert padded.req_rows.tolist() == [5, 2, 6] + [0] * 5
    assert padded.seq_lens.tolist() == [5, 11, 3] + [1] * 5
    assert pad_decode(step, 3).seq_lens.tolist() == [5, 11, 3]  # an exact fit adds nothing
    with pytest.raises(ValueError, match="does not pad"):
        pad_decode(step, 2)
    extend = dataclasses.replace(step, mode=ForwardMode.EXTEND)
    with pytest.raises(ValueError, match="only a decode step"):
        pad_decode(extend, 4)


# ---- the fixed-shape decode attention ------------------------------------------------------------

SEQ_LENS = [1, 17, 64, 3]  # ragged: masks on, one request at the first position
PADDED_BS, BUCKET = 8, 96  # four padding rows; a bucket longer than every request


def _pool_and_table(pool, seq_lens, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's cached tokens at scattered slots (as a long-running pool has them), slot 0 left to
    padding. -> (request -> token table [rows, 129], each request's newest slot)."""
    gen = torch.Generator().manual_seed(1)
    table = torch.zeros(len(seq_lens), 129, dtype=torch.int64)
    order = torch.randperm(pool.size, generator=gen) + 1
    taken = 0
    for row, length in enumerate(seq_lens):
        slots = order[taken : taken + length]
        table[row, :length] = slots
        fill(slots, gen)
        taken += length
    return table, table[torch.arange(len(seq_lens)), torch.tensor(seq_lens) - 1]


def _batches(backend, pool, table, last, seq_lens):
    """The eager decode batch, and the padded fixed-shape one (what a graph captures)."""
    eager = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(len(seq_lens), dtype=torch.int64),
        positions=torch.tensor(seq_lens) - 1, out_slots=last, req_rows=torch.arange(len(seq_lens)),
        seq_lens=list(seq_lens), prefix_lens=[s - 1 for s in seq_lens], req_to_token=table, kv_pool=pool,
        attn_backend=backend,
    )
    backend.prepare(eager)
    step = StepInput(mode=ForwardMode.DECODE, input_ids=eager.input_ids, positions=eager.positions,
                     out_slots=last, req_rows=eager.req_rows, seq_lens=list(seq_lens), prefix_lens=eager.prefix_lens)
    padded = pad_decode(step, PADDED_BS)
    fixed = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=padded.input_ids, positions=padded.positions, out_slots=padded.out_slots,
        req_rows=padded.req_rows, seq_lens=[1] * PADDED_BS, prefix_lens=[0] * PADDED_BS, req_to_token=table,
        kv_pool=pool, attn_backend=backend,
    )
    backend.prepare_fixed_decode(fixed, padded.seq_lens, BUCKET)
    return eager, fixed


def _padded(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """x's rows then PADDED_BS - len(x) random rows (the padding rows' own q/k/v)."""
    extra = torch.randn(PADDED_BS - x.shape[0], *x.shape[1:], generator=generator, dtype=x.dtype)
    return torch.cat((x, extra))


def _check_slot_writes(before: list[torch.Tensor], after: list[torch.Tensor], last: torch.Tensor) -> None:
    """The padded step changed only the real requests' newest slots (re-stored unchanged) and slot 0."""
    for old, new in zip(before, after, strict=True):
        changed = (old != new).reshape(old.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        assert changed == [0], changed
        assert torch.equal(old[last], new[last])


MHA_IMPLS = ["grouped_matmul", "sdpa"] + (["avx2"] if CPU_OPS is not None else [])


@pytest.mark.parametrize("impl", MHA_IMPLS)
def test_fixed_shape_mha_decode_equals_the_eager_decode(impl) -> None:
    heads, kv_heads, dim = 8, 2, 16
    pool = MHAKVPool(255, 1, kv_heads, dim, torch.float32, torch.device("cpu"))

    def fill(slots, gen):
        pool.k_buffers[0][slots] = torch.randn(len(slots), kv_heads, dim, generator=gen)
        pool.v_buffers[0][slots] = torch.randn(len(slots), kv_heads, dim, generator=gen)

    table, last = _pool_and_table(pool, SEQ_LENS, fill)
    backend = TorchNativeAttentionBackend(decode_impl=impl, cpu_ops=CPU_OPS)
    eager, fixed = _batches(backend, pool, table, last, SEQ_LENS)
    layer = AttentionLayer(0, heads, kv_heads, dim, scaling=dim**-0.5)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(len(SEQ_LENS), heads, dim, generator=gen)
    k_new, v_new = pool.k_buffers[0][last].clone(), pool.v_buffers[0][last].clone()  # re-stored as the model would
    expected = backend.forward(q, k_new, v_new, layer, eager)
    before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
    out = backend.forward(_padded(q, gen), _padded(k_new, gen), _padded(v_new, gen), layer, fixed)
    assert out.shape == (PADDED_BS, heads * dim)
    torch.testing.assert_close(out[: len(SEQ_LENS)], expected, rtol=0, atol=1e-5)
    assert torch.isfinite(out).all()  # padding rows attend to one position (row 0's first), not to nothing
    _check_slot_writes(before, pool.k_buffers + pool.v_buffers, last)


@pytest.mark.parametrize("mode", ["absorbed", "normal"])
def test_fixed_shape_mla_decode_equals_the_eager_decode(mode) -> None:
    heads, kv_lora, nope, rope, v_dim = 4, 32, 16, 8, 16
    pool = MLAKVPool(255, 1, kv_lora, rope, torch.float32, torch.device("cpu"))

    def fill(slots, gen):
        pool.latent_buffers[0][slots] = torch.randn(len(slots), kv_lora + rope, generator=gen)

    table, last = _pool_and_table(pool, SEQ_LENS, fill)
    backend = TorchNativeMLABackend(mla_decode=mode)
    eager, fixed = _batches(backend, pool, table, last, SEQ_LENS)
    torch.manual_seed(3)
    layer = MLAAttentionLayer(0, heads, kv_lora, nope, rope, v_dim, scaling=(nope + rope) ** -0.5,
                              kv_b_proj=torch.nn.Linear(kv_lora, heads * (nope + v_dim), bias=False))
    gen = torch.Generator().manual_seed(4)
    q_nope = torch.randn(len(SEQ_LENS), heads, nope, generator=gen)
    q_pe = torch.randn(len(SEQ_LENS), heads, rope, generator=gen)
    latent = pool.latent_buffers[0][last].clone()
    with torch.inference_mode():
        expected = backend.forward_mla(q_nope, q_pe, latent, layer, eager)
        before = [b.clone() for b in pool.latent_buffers]
        out = backend.forward_mla(_padded(q_nope, gen), _padded(q_pe, gen), _padded(latent, gen), layer, fixed)
    torch.testing.assert_close(out[: len(SEQ_LENS)], expected, rtol=0, atol=1e-5)
    assert torch.isfinite(out).all()
    _check_slot_writes(before, pool.latent_buffers, last)


# ---- the static-buffer forward against the eager decode ------------------------------------------


class Requests:
    """Drives a runner directly, with requests joining (prefilled in one extend step) and finishing (their
    row and slots freed) between decode steps, doing the KV bookkeeping on the runner's cache."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.kv = runner.kv
        self.live: dict[str, tuple[int, list[int]]] = {}  # rid -> (table row, its KV slots in position order)

    def join(self, rid: str, prompt: list[int]) -> torch.Tensor:
        row = self.kv.req_table.alloc()
        slots = self.kv.allocator.alloc(len(prompt))
        assert row is not None and slots is not None
        self.live[rid] = (row, slots.tolist())
        return self.runner.forward(StepInput(
            mode=ForwardMode.EXTEND, input_ids=torch.tensor(prompt), positions=torch.arange(len(prompt)),
            out_slots=slots, req_rows=torch.tensor([row]), seq_lens=[len(prompt)], prefix_lens=[0],
        ))

    def finish(self, rid: str) -> None:
        row, slots = self.live.pop(rid)
        self.kv.req_table.free(row)
        self.kv.allocator.free(torch.tensor(slots))

    def decode(self, tokens: dict[str, int]) -> torch.Tensor:
        slots = self.kv.allocator.alloc(len(tokens))
        assert slots is not None
        lens = [len(self.live[rid][1]) for rid in tokens]
        for rid, slot in zip(tokens, slots.tolist(), strict=True):
            self.live[rid][1].append(slot)
        return self.runner.forward(StepInput(
            mode=ForwardMode.DECODE, input_ids=torch.tensor(list(tokens.values())), positions=torch.tensor(lens),
            out_slots=slots, req_rows=torch.tensor([self.live[rid][0] for rid in tokens]),
            seq_lens=[n + 1 for n in lens], prefix_lens=lens,
        ))

    def context(self) -> int:
        return max(len(slots) for _, slots in self.live.values())


GRAPH_SIZES, GRAPH_BUCKETS = [1, 2, 4, 8], [16, 32, 64]


def _engine_config(model_dir: Path, **overrides) -> EngineConfig:
    return EngineConfig(model_path=str(model_dir), dtype="float32", max_total_tokens=2048, max_running_requests=12,
                        **overrides)


def _lockstep(eager: Requests, graphed: Requests, script, atol: float) -> tuple[int, int]:
    """Run ``script`` (joins, finishes, decode rounds) on both; every decode step's logits must agree.
    -> (decode steps, decode steps the graph runner ran)."""
    runner = graphed.runner.cuda_graphs
    assert runner is not None
    steps = fitting = 0
    next_tokens: dict[str, int] = {}
    for action, *args in script:
        if action == "join":
            rid, prompt = args
            logits = [r.join(rid, prompt) for r in (eager, graphed)]
            # Extend: the same eager path (on CUDA the MoE's index_add_ sums by atomics, in any order).
            exact = eager.runner.device.type == "cpu"
            torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0 if exact else atol)
            next_tokens[rid] = int(logits[0].argmax())
        elif action == "finish":
            for r in (eager, graphed):
                r.finish(args[0])
            next_tokens.pop(args[0])
        else:
            for _ in range(args[0]):
                fits = fit(len(next_tokens), GRAPH_SIZES) is not None and fit(eager.context() + 1, GRAPH_BUCKETS)
                logits = [r.decode(dict(next_tokens)) for r in (eager, graphed)]
                assert logits[1].shape == logits[0].shape == (len(next_tokens), logits[0].shape[-1])
                torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=atol)
                next_tokens = dict(zip(next_tokens, logits[0].argmax(dim=-1).tolist(), strict=True))
                steps += 1
                fitting += bool(fits)
    assert eager.live.keys() == graphed.live.keys()
    assert all(eager.live[rid] == graphed.live[rid] for rid in eager.live)  # the same rows and slots
    return steps, fitting


# fp32 logits (up to ~63 on these models; one ulp there is 3.8e-6), two sources of rounding noise:
# - a padded batch's GEMMs have more rows than the eager step's, and this host's BLAS rounds the rows of a
#   partial 4-row tile differently (tests/unit/test_two_batch_overlap.py): measured 1.7e-5..6.1e-5 per step,
#   the same from the first step on and not growing over the 23 steps (the cached K/V carry it on);
# - the torch decode attention (grouped matmuls, MLA's matmuls: what CUDA runs) reduces over the context
#   bucket, longer than the eager step's context: another summation order, measured 0.9e-5..4.2e-5 with
#   no padding rows. The AVX2 kernel reads each request's own length: bit-identical there.
# Bound: the oracle tests' 1e-4; 1e-5 where neither applies (the AVX2 kernel, no padding rows).
ATOL = 1e-4
# (model, decode attention): the x86 CPU default, the kernel CUDA runs for Llama, MLA's absorbed decode.
CASES = [pytest.param("llama", "avx2", marks=pytest.mark.skipif(CPU_OPS is None, reason="AVX2 kernels unavailable")),
         ("llama", "grouped_matmul"), ("deepseek_v2", "absorbed")]


def _script(prompts: list[list[int]]) -> list[tuple]:
    return [
        ("join", "a", prompts[0][:3]), ("join", "b", prompts[1][:9]), ("join", "c", prompts[2][:5]),
        ("decode", 4),  # 3 requests pad to 4; contexts cross the 16-token bucket
        ("join", "d", prompts[3][:12]), ("decode", 3),  # 4 requests: an exact fit
        ("finish", "b"), ("decode", 2),  # rows no longer contiguous
        *[("join", f"e{i}", prompts[4][: 2 + i]) for i in range(5)], ("decode", 2),  # 8 requests
        ("join", "f", prompts[4][:4]), ("decode", 2),  # 9 requests: no graph fits, eager
        ("finish", "f"), ("finish", "a"), ("finish", "e0"),
        ("join", "g", (prompts[4] * 3)[:60]), ("decode", 8),  # contexts 61..68: past the last bucket (64) eager
        ("finish", "g"), ("decode", 2),
    ]


def _runner_pair(model_dir: Path, name: str, attention: str) -> tuple[Requests, Requests, CudaGraphRunner]:
    """Two runners of one model: eager, and one whose decode steps go through a CUDA-graph runner that
    calls its graphs' function eagerly (on the CPU the engine never builds one)."""
    moe = {"moe_experts": "grouped"} if name == "deepseek_v2" else {}  # the host-sync-free MoE CUDA captures
    runners = [ModelRunner(_engine_config(model_dir, **moe)) for _ in range(2)]
    if name == "llama":
        for runner in runners:
            runner.attn_backend = TorchNativeAttentionBackend(decode_impl=attention, cpu_ops=CPU_OPS)
    assert runners[1].cuda_graphs is None
    graphs = CudaGraphRunner(runners[1].model, runners[1].kv, runners[1].attn_backend, GRAPH_SIZES, GRAPH_BUCKETS,
                             capture=False)
    runners[1].cuda_graphs = graphs
    return Requests(runners[0]), Requests(runners[1]), graphs


@pytest.mark.parametrize("name,attention", CASES)
def test_static_buffer_forward_equals_the_eager_decode(model_factory, name, attention) -> None:
    """The function a graph captures, run eagerly, over decode steps of 3..9 requests joining and
    finishing, contexts from 4 to 68: the eager decode's logits; steps no graph fits run eagerly."""
    model_dir = model_factory("tiny", arch=name)
    eager, graphed, graphs = _runner_pair(model_dir, name, attention)
    steps, fitting = _lockstep(eager, graphed, _script(encode_prompts(model_dir)), atol=ATOL)
    assert graphs.steps_run == fitting
    assert (steps, fitting) == (23, 17)  # 2 steps of 9 requests and 4 past the last bucket ran eagerly


@pytest.mark.parametrize("name,attention", CASES)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_exact_fits_give_the_eager_logits(model_factory, name, attention, n) -> None:
    """n requests, a captured size: no padding rows, only the context bucket (longer than every request,
    crossing 16 -> 32 -> 64 over the steps) and the always-on length mask differ from the eager decode."""
    model_dir = model_factory("tiny", arch=name)
    eager, graphed, graphs = _runner_pair(model_dir, name, attention)
    prompts = encode_prompts(model_dir)
    script = [*[("join", str(i), prompts[i % 5][: 4 + 3 * i]) for i in range(n)], ("decode", 14)]
    steps, fitting = _lockstep(eager, graphed, script, atol=1e-5 if attention == "avx2" else ATOL)
    assert steps == fitting == graphs.steps_run == 14


def test_steps_that_fit_no_graph_are_left_to_the_eager_path(tiny_model) -> None:
    runner = ModelRunner(_engine_config(tiny_model))
    graphs = CudaGraphRunner(runner.model, runner.kv, runner.attn_backend, GRAPH_SIZES, GRAPH_BUCKETS, capture=False)
    decode = _decode_step([1, 2, 3], [9, 19, 4], [5, 6, 7], [0, 1, 2])
    assert graphs.shape_for(decode) == (4, 32)
    assert graphs.shape_for(_decode_step([1], [15], [5], [0])) == (1, 16)  # a context of 16 fits bucket 16
    assert graphs.shape_for(_decode_step([1] * 9, [3] * 9, list(range(1, 10)), list(range(9)))) is None
    assert graphs.shape_for(_decode_step([1], [64], [5], [0])) is None  # 65 tokens: past the last bucket
    assert graphs.shape_for(dataclasses.replace(decode, mode=ForwardMode.EXTEND)) is None
    assert graphs.shape_for(dataclasses.replace(decode, all_logits=True)) is None
    assert graphs.run(dataclasses.replace(decode, mode=ForwardMode.EXTEND)) is None and graphs.steps_run == 0
    with pytest.raises(ValueError, match="exceeds the request table"):
        CudaGraphRunner(runner.model, runner.kv, runner.attn_backend, [1], [runner.kv.req_table.max_context_len + 1],
                        capture=False)
    with pytest.raises(ValueError, match="ascending"):
        CudaGraphRunner(runner.model, runner.kv, runner.attn_backend, [4, 2], [16], capture=False)


# What a capture cannot hold: a device value read on the host, an output sized by the data, and a tensor
# made from host data (lift_fresh: torch.tensor(list), an H2D copy from pageable memory on CUDA).
NOT_CAPTURABLE = HOST_SYNC_OPS | {"lift_fresh"}


@pytest.mark.parametrize("name,attention", [("llama", "grouped_matmul"), ("llama", "sdpa"), ("deepseek_v2", "absorbed"),
                                            ("deepseek_v2", "normal")])
def test_the_captured_function_reads_nothing_from_the_host(model_factory, name, attention) -> None:
    """Every aten op of the function a graph holds, recorded on the CPU: none of them needs the host (the
    recorder sees the eager decode's host-built metadata and the MoE loop's sync, so its silence means
    something)."""
    model_dir = model_factory("tiny", arch=name)
    overrides = {"moe_experts": "grouped", "mla_decode": attention} if name == "deepseek_v2" else {}
    runner = ModelRunner(_engine_config(model_dir, **overrides))
    if name == "llama":
        runner.attn_backend = TorchNativeAttentionBackend(decode_impl=attention)
    graphs = CudaGraphRunner(runner.model, runner.kv, runner.attn_backend, GRAPH_SIZES, GRAPH_BUCKETS, capture=False)
    requests = Requests(runner)
    requests.join("a", [1, 2, 3])
    with OpRecorder() as eager:
        requests.decode({"a": 4})
    assert "lift_fresh" in eager.ops
    with torch.inference_mode(), OpRecorder() as static:
        graphs.forward_static(4, 32)
    assert not static.ops & NOT_CAPTURABLE, static.ops & NOT_CAPTURABLE
    if name == "deepseek_v2":
        loop = ModelRunner(_engine_config(model_dir, moe_experts="loop"))
        with torch.inference_mode(), OpRecorder() as looped:
            CudaGraphRunner(loop.model, loop.kv, loop.attn_backend, [4], [32], capture=False).forward_static(4, 32)
        assert looped.ops & HOST_SYNC_OPS  # why graph_plan turns graphs off for the MoE loop


# ---- when graphs are used ------------------------------------------------------------------------


def test_flags_reach_the_engine_config() -> None:
    from llmserve.commands.engine_args import add_engine_args, engine_argv, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    default = engine_config_from_args(parser.parse_args(["--model", "m"]))
    assert not default.disable_cuda_graph and default.cuda_graph_max_bs is None
    args = parser.parse_args(["--model", "m", "--disable-cuda-graph", "--cuda-graph-max-bs", "16"])
    config = engine_config_from_args(args)
    assert config.disable_cuda_graph and config.cuda_graph_max_bs == 16
    argv = engine_argv(args)  # what a TP follower or a worker under `serve` is started with
    assert "--disable-cuda-graph" in argv and argv[argv.index("--cuda-graph-max-bs") + 1] == "16"
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        dataclasses.replace(config, cuda_graph_max_bs=0)


def test_on_the_cpu_graphs_resolve_off_and_no_runner_is_built(tiny_model) -> None:
    config = _engine_config(tiny_model)
    assert not config.disable_cuda_graph  # the default: on wherever it can be
    runner = ModelRunner(config)
    assert runner.cuda_graphs is None
    plan = graph_plan(config, runner.device, runner.tp, runner.model, 2048)
    assert not plan.enabled and "device cpu" in plan.reason


def test_graph_plan_on_cuda(model_factory) -> None:
    """What a CUDA rank would capture, and where it cannot: decided from the config, the TP group and the
    model alone (the device object's type; nothing runs on a GPU)."""
    llama = ModelRunner(_engine_config(model_factory("tiny")))
    config = llama.engine_config
    plan = graph_plan(config, CUDA, TPContext(), llama.model, 1000)
    assert plan.enabled
    assert plan.batch_sizes == (1, 2, 4, 8, 12)  # up to --max-running-requests by default
    assert plan.context_buckets == (256, 512, 1000)
    assert graph_plan(dataclasses.replace(config, cuda_graph_max_bs=4), CUDA, TPContext(), llama.model,
                      1000).batch_sizes == (1, 2, 4)
    assert graph_plan(dataclasses.replace(config, cuda_graph_max_bs=64), CUDA, TPContext(), llama.model,
                      1000).batch_sizes == (1, 2, 4, 8, 12)  # never past the largest possible decode
    disabled = graph_plan(dataclasses.replace(config, disable_cuda_graph=True), CUDA, TPContext(), llama.model, 1000)
    assert not disabled.enabled and disabled.reason == "--disable-cuda-graph"
    (store, group), _ = gloo_groups(2, "cuda-graph-plan")
    gloo = graph_plan(config, CUDA, TPContext(rank=0, size=2, group=group, store=store), llama.model, 1000)
    assert not gloo.enabled and "over gloo cannot be captured" in gloo.reason
    from worker_svc.parallel.collective_observer import CollectiveRecorder

    observed = TPContext(rank=0, size=2, group=group, store=store, observer=CollectiveRecorder())
    assert "profiling" in graph_plan(config, CUDA, observed, llama.model, 1000).reason
    deepseek = model_factory("tiny", arch="deepseek_v2")
    loop = ModelRunner(_engine_config(deepseek, moe_experts="loop"))
    looped = graph_plan(loop.engine_config, CUDA, TPContext(), loop.model, 1000)
    assert not looped.enabled and "--moe-experts grouped" in looped.reason
    # torch._grouped_mm runs on the device only for bf16 on sm90/sm100 (H100, H200, B200).
    fp32 = ModelRunner(_engine_config(deepseek, moe_experts="grouped"))
    host_loop = graph_plan(fp32.engine_config, CUDA, TPContext(), fp32.model, 1000, capability=(9, 0))
    assert not host_loop.enabled and "torch._grouped_mm" in host_loop.reason
    bf16 = ModelRunner(dataclasses.replace(_engine_config(deepseek, moe_experts="grouped"), dtype="bfloat16"))
    assert graph_plan(bf16.engine_config, CUDA, TPContext(), bf16.model, 1000, capability=(9, 0)).enabled
    assert not graph_plan(bf16.engine_config, CUDA, TPContext(), bf16.model, 1000, capability=(8, 0)).enabled


# ---- on a CUDA device: capture and replay --------------------------------------------------------


def _sm90_or_sm100() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


# (model, dtype, atol): Llama in fp32; DeepSeek-V2 in bf16, where its grouped MoE GEMMs run on the device
# (fp32 ones loop on the host: graphs off). The bf16 bound is a loose guess (not calibrated on a GPU):
# bf16 logits of these models round at ~0.03-0.06, and a wrong row or stale KV moves them by whole units.
GPU_CASES = [("llama", "float32", ATOL),
             pytest.param("deepseek_v2", "bfloat16", 0.5,
                          marks=pytest.mark.skipif(not _sm90_or_sm100(), reason="grouped MoE GEMMs need sm90/sm100"))]


@needs_cuda
@pytest.mark.parametrize("name,dtype,atol", GPU_CASES)
def test_captured_graphs_replay_the_eager_decode_on_cuda(model_factory, name, dtype, atol) -> None:
    """The graphs themselves: captured at start (batch 1..8, one 256-token bucket), replayed for every
    decode step of at most 8 requests of the join/finish script, equal to the eager CUDA decode (whose
    step inputs come from the host, as the scheduler builds them)."""
    model_dir = model_factory("tiny", arch=name)
    config = dataclasses.replace(_engine_config(model_dir, device="cuda", context_length=256, cuda_graph_max_bs=8),
                                 dtype=dtype)
    eager = Requests(ModelRunner(dataclasses.replace(config, disable_cuda_graph=True)))
    assert eager.runner.cuda_graphs is None
    graphed_runner = ModelRunner(config)
    graphs = graphed_runner.cuda_graphs
    assert graphs is not None and graphs.captured
    assert graphs.batch_sizes == GRAPH_SIZES and graphs.context_buckets == [256]
    steps, _ = _lockstep(eager, Requests(graphed_runner), _script(encode_prompts(model_dir)), atol=atol)
    assert (steps, graphs.steps_run) == (23, 21)  # the 2 steps of 9 requests ran eagerly
