"""CUDA graphs for decode steps (``--disable-cuda-graph``, ``--cuda-graph-max-bs``), as sglang's
CudaGraphRunner: a decode step launches hundreds of small kernels whose launch cost, not the GPU, sets its
time at small batches; a captured graph replays them all with one launch.

What a graph holds: the whole decode forward (embedding, every layer, the LM head) over static device
buffers of a padded batch (token ids, positions, the KV slots written, request rows, lengths), with the
attention metadata built inside the graph from those buffers at a fixed context bucket (the backend's
``prepare_fixed_decode``: a [batch, bucket] gather of the request -> token table and a length mask, no
host read). One graph per (padded batch size, context bucket), captured at start, largest first, into one
memory pool: graphs replay one at a time, so they share its memory.

A decode step of n requests whose longest context is L replays the graph of the smallest captured size
>= n and the smallest bucket >= L after copying its inputs into the buffers. Padding rows are token 0
at position 0 of request row 0 with length 1: they write their K/V into slot 0 (the allocator's padding
slot, which no request owns), only read (row 0's first slot), and their logits are dropped. Steps that do not fit
(extend and mixed steps, all-logits scoring, more requests than the largest size, a context past the
last bucket) run eagerly, as do all steps when graphs cannot be used (``graph_plan``: not CUDA,
``--disable-cuda-graph``, tensor parallelism over anything but NCCL, collective profiling, MoE experts
that sync with the host).

The model files know nothing of this: the runner hands the model an ordinary ``ForwardBatch`` whose
tensors are the buffers. On the CPU it is never built; the tests run it with ``capture=False`` (the same
buffers, padding and function, called eagerly) to hold it equal to the eager decode.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from worker_svc.attention.base import StepAttentionBackend
from worker_svc.config.engine_config import EngineConfig
from worker_svc.forward_batch import ForwardBatch, ForwardMode, StepInput
from worker_svc.kvcache import KVCache
from worker_svc.layers.moe import DeepseekMoE
from worker_svc.parallel.context import TPContext

log = structlog.get_logger(__name__)

# The smallest context bucket; each next one doubles, up to the longest context a request can reach.
# Attention over a bucket costs batch x bucket, so buckets keep short contexts from paying for long ones.
SMALLEST_CONTEXT_BUCKET = 256


def capture_batch_sizes(max_bs: int) -> list[int]:
    """sglang's list: 1, 2, 4, 8, then every 8 from 16, up to ``max_bs`` (itself included)."""
    if max_bs < 1:
        raise ValueError(f"the largest CUDA-graph batch size must be positive, got {max_bs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def context_buckets(max_context: int, smallest: int = SMALLEST_CONTEXT_BUCKET) -> list[int]:
    """``smallest``, doubling, then ``max_context`` itself as the last bucket."""
    if max_context < 1:
        raise ValueError(f"the longest context must be positive, got {max_context}")
    buckets = []
    bucket = smallest
    while bucket < max_context:
        buckets.append(bucket)
        bucket *= 2
    return [*buckets, max_context]


def fit(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``n``, or None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class GraphPlan:
    """Whether this rank captures decode graphs, and at which shapes (both ascending)."""

    enabled: bool
    reason: str  # why not, when disabled
    batch_sizes: tuple[int, ...] = ()
    context_buckets: tuple[int, ...] = ()


def graph_plan(engine_config: EngineConfig, device: torch.device, tp: TPContext, model: nn.Module,
               max_context: int, capability: tuple[int, int] | None = None) -> GraphPlan:
    """Graphs on CUDA unless disabled or the step cannot be captured; ``max_context``: the longest
    sequence a request can reach (the context length, or the KV pool if smaller); ``capability``: the
    CUDA device's compute capability."""

    def off(reason: str) -> GraphPlan:
        return GraphPlan(enabled=False, reason=reason)

    if device.type != "cuda":
        return off(f"device {device.type}: CUDA graphs need CUDA")
    if engine_config.disable_cuda_graph:
        return off("--disable-cuda-graph")
    if tp.size > 1 and tp.observer is not None:
        return off("collective profiling times every collective on the host")
    if tp.size > 1 and tp.comm_kind != "nccl":
        return off(f"tensor-parallel collectives over {tp.comm_kind} cannot be captured (NCCL's can)")
    moes = [m for m in model.modules() if isinstance(m, DeepseekMoE)]
    if any(m.grouped is None for m in moes):
        return off("MoE experts run as a loop with a host sync per layer (--moe-experts grouped has none)")
    grouped = [m.grouped for m in moes if m.grouped is not None]
    if grouped and (grouped[0].gate_up_t.dtype != torch.bfloat16 or capability is None or capability[0] not in (9, 10)):
        # torch._grouped_mm has a CUDA kernel for bf16 on sm90/sm100 only; elsewhere it loops over the
        # groups on the host (offs.cpu()), which a capture cannot hold.
        return off("grouped MoE GEMMs outside bf16 on sm90/sm100 loop on the host (torch._grouped_mm)")
    max_bs = min(engine_config.cuda_graph_max_bs or engine_config.max_running_requests,
                 engine_config.max_running_requests)
    return GraphPlan(enabled=True, reason="", batch_sizes=tuple(capture_batch_sizes(max_bs)),
                     context_buckets=tuple(context_buckets(max_context)))


@dataclass(frozen=True)
class PaddedDecode:
    """A decode step's inputs padded to a captured batch size, each [bs] int64."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    req_rows: torch.Tensor
    seq_lens: torch.Tensor


def _pad(values: torch.Tensor, bs: int, fill: int) -> torch.Tensor:
    values = values.reshape(-1).to(torch.int64)
    return torch.cat((values, values.new_full((bs - values.numel(),), fill)))


def pad_decode(step: StepInput, bs: int) -> PaddedDecode:
    """The step's inputs with ``bs - batch`` padding rows appended: token 0 at position 0 of request row 0
    with length 1, writing KV slot 0 (reserved as the padding target, kvcache/allocator.py)."""
    n = len(step.seq_lens)
    if step.mode is not ForwardMode.DECODE or step.input_ids.numel() != n:
        raise ValueError("only a decode step (one token per request) pads to a graph's batch")
    if not 0 < n <= bs:
        raise ValueError(f"a decode of {n} requests does not pad to batch size {bs}")
    return PaddedDecode(
        input_ids=_pad(step.input_ids, bs, 0),
        positions=_pad(step.positions, bs, 0),
        out_slots=_pad(step.out_slots, bs, 0),
        req_rows=_pad(step.req_rows, bs, 0),
        seq_lens=_pad(torch.tensor(step.seq_lens, dtype=torch.int64), bs, 1),
    )


class DecodeBuffers:
    """The static inputs every graph reads, allocated once at the largest batch size on the device; a
    graph of batch size bs reads their first bs rows. A step's inputs are copied in before a replay."""

    def __init__(self, max_bs: int, device: torch.device) -> None:
        self.max_bs = max_bs
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.out_slots = torch.zeros(max_bs, dtype=torch.int64, device=device)  # slot 0: the padding slot
        self.req_rows = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)

    def load(self, padded: PaddedDecode) -> None:
        bs = padded.input_ids.numel()
        for name in ("input_ids", "positions", "out_slots", "req_rows", "seq_lens"):
            getattr(self, name)[:bs].copy_(getattr(padded, name), non_blocking=True)

    def view(self, bs: int) -> PaddedDecode:
        return PaddedDecode(self.input_ids[:bs], self.positions[:bs], self.out_slots[:bs], self.req_rows[:bs],
                            self.seq_lens[:bs])


class CudaGraphRunner:
    """Replays a captured decode graph for every decode step that fits one (``run``)."""

    def __init__(self, model: nn.Module, kv: KVCache, backend: StepAttentionBackend, batch_sizes: Sequence[int],
                 context_buckets: Sequence[int], capture: bool = True) -> None:
        """``capture=False`` (tests on the CPU): no graphs, ``run`` calls what a graph would hold eagerly."""
        if list(batch_sizes) != sorted(set(batch_sizes)) or list(context_buckets) != sorted(set(context_buckets)):
            raise ValueError("CUDA-graph batch sizes and context buckets must be ascending and distinct")
        if context_buckets[-1] > kv.req_table.max_context_len:
            raise ValueError(f"context bucket {context_buckets[-1]} exceeds the request table's "
                             f"{kv.req_table.max_context_len} tokens")
        self.model = model
        self.kv = kv
        self.backend = backend
        self.batch_sizes = list(batch_sizes)
        self.context_buckets = list(context_buckets)
        self.device = kv.req_table.table.device
        self.captured = capture
        self.steps_run = 0  # decode steps this runner ran (replayed, or called eagerly without capture)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        with torch.inference_mode():
            self.buffers = DecodeBuffers(self.batch_sizes[-1], self.device)
            if capture:
                self._capture()

    def shape_for(self, step: StepInput) -> tuple[int, int] | None:
        """(padded batch size, context bucket) of the graph that runs ``step``, or None: run it eagerly."""
        if step.mode is not ForwardMode.DECODE or step.all_logits or not step.seq_lens:
            return None
        bs = fit(len(step.seq_lens), self.batch_sizes)
        bucket = fit(max(step.seq_lens), self.context_buckets)
        return None if bs is None or bucket is None else (bs, bucket)

    def run(self, step: StepInput) -> torch.Tensor | None:
        """float32 logits [batch, vocab] of a decode step that fits a graph, None for one that does not.
        The request -> token table must already hold the step's slots (ModelRunner._record_slots)."""
        shape = self.shape_for(step)
        if shape is None:
            return None
        self.buffers.load(pad_decode(step, shape[0]))
        if self.captured:
            self._graphs[shape].replay()
            logits = self._outputs[shape]
        else:
            logits = self.forward_static(*shape)
        self.steps_run += 1
        # A copy: the graph's output is overwritten by the next replay of any graph in the pool.
        return logits[: len(step.seq_lens)].clone()

    def forward_static(self, bs: int, bucket: int) -> torch.Tensor:
        """What a graph captures: the decode forward over the first ``bs`` rows of the buffers, attending
        over ``bucket`` context positions. -> float32 logits [bs, vocab] (padding rows included)."""
        inputs = self.buffers.view(bs)
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            out_slots=inputs.out_slots,
            req_rows=inputs.req_rows,
            # Decode reads only the number of these host lists (the batch size); the lengths themselves
            # are the device tensor in the fixed metadata, so one graph serves every step of its shape.
            seq_lens=[1] * bs,
            prefix_lens=[0] * bs,
            req_to_token=self.kv.req_table.table,
            kv_pool=self.kv.pool,
            attn_backend=self.backend,
        )
        self.backend.prepare_fixed_decode(batch, inputs.seq_lens, bucket)
        return self.model(batch)

    def _capture(self) -> None:
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        pool = torch.cuda.graph_pool_handle()
        # The buffers hold padding rows (slot 0, row 0, length 1) while capturing: the warm-up runs write
        # only the padding slot.
        for bs in reversed(self.batch_sizes):  # largest first: the smaller graphs fit in the pool it leaves
            for bucket in reversed(self.context_buckets):
                # One eager run first, on the capture stream: lazy initialisation (cuBLAS handles and
                # workspaces, NCCL communicators) must not happen inside a capture.
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self.forward_static(bs, bucket)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                try:
                    # thread_local: only this thread's calls are checked; other threads (NCCL's watchdog
                    # polling the events of earlier collectives) may keep querying the device meanwhile.
                    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                        out = self.forward_static(bs, bucket)
                except RuntimeError as exc:
                    raise RuntimeError(f"capturing the decode CUDA graph (batch {bs}, context {bucket}) failed: "
                                       f"{exc}; --disable-cuda-graph runs decode eagerly") from exc
                self._graphs[(bs, bucket)] = graph
                self._outputs[(bs, bucket)] = out
        torch.cuda.synchronize(self.device)
        log.info("cuda graphs captured", graphs=len(self._graphs), batch_sizes=self.batch_sizes,
                 context_buckets=self.context_buckets, seconds=round(time.perf_counter() - start, 2),
                 reserved_bytes=torch.cuda.memory_reserved(self.device))
