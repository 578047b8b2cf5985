"""Two-batch overlap (``--enable-two-batch-overlap``): one step's requests run as two micro-batches, and
layer by layer one micro-batch's tensor-parallel all-reduce is in flight while the other computes.

Per layer (A and B the micro-batches; "start" issues the all-reduce, "wait" completes it):

    wait A(mlp of the layer before) -> A.attention -> start A
    wait B(mlp of the layer before) -> B.attention -> start B
    wait A                          -> A.mlp       -> start A
    wait B                          -> B.mlp       -> start B

so at most two all-reduces are in flight, and each has the other micro-batch's stage to complete in.
The models only expose the stages (models/decoder.py: ``attention_stage`` / ``mlp_stage`` return
un-reduced partial sums); this module is the one place that orders them. The embedding's reduction and
the LM head runs once, on both micro-batches' final rows.

The split is a pure function of the StepInput and the engine config, so every TP rank splits the
broadcast step the same way with no protocol change. It cuts the step's tokens where the two halves'
cost is most even (per token: 1 for the linear layers plus its context length / 2048 for attention:
uneven halves lose the gain, sglang #6328). A cut inside a request (a long extend) gives its first part
to A and the rest to B, which attends to the first part's KV: A's attention of a layer writes it
before B's attention of that layer reads it. Steps under ``--tbo-min-tokens`` tokens are not split.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch

from worker_svc.forward_batch import ForwardBatch, StepInput
from worker_svc.models.decoder import CausalLM
from worker_svc.parallel.collective_observer import WorkHandle
from worker_svc.parallel.context import TPContext

# Attention cost per (query token x context token) relative to the linear layers' cost per token.
ATTENTION_WEIGHT = 1.0 / 2048


@dataclass(frozen=True)
class TwoBatchSplit:
    first: StepInput
    second: StepInput
    # A request cut in two: its last row in the first half's logits is not a final token, dropped.
    cut_request: bool


def split_step(step: StepInput, min_tokens: int) -> TwoBatchSplit | None:
    """The step as two micro-batches (A's tokens first, then B's, in the step's order), or None when
    it is too small to split."""
    tokens = int(step.input_ids.numel())
    if tokens < max(2, min_tokens):
        return None
    cost = 1.0 + ATTENTION_WEIGHT * (step.positions.double() + 1)  # [tokens]
    running = torch.cumsum(cost, 0)
    cut = int(torch.argmin((2 * running[:-1] - running[-1]).abs())) + 1  # tokens in A, 1..tokens-1
    ends = list(itertools.accumulate(seq - prefix for seq, prefix in zip(step.seq_lens, step.prefix_lens, strict=True)))
    i = bisect.bisect_right(ends, cut)  # the request holding token `cut`
    inside = cut - (ends[i - 1] if i else 0)  # tokens of request i that go to A (0: the cut is at its start)
    head = i + 1 if inside else i
    first = StepInput(
        mode=step.mode,
        input_ids=step.input_ids[:cut], positions=step.positions[:cut], out_slots=step.out_slots[:cut],
        req_rows=step.req_rows[:head],
        seq_lens=step.seq_lens[:i] + ([step.prefix_lens[i] + inside] if inside else []),
        prefix_lens=step.prefix_lens[:head],
        all_logits=step.all_logits,
    )
    second = StepInput(
        mode=step.mode,
        input_ids=step.input_ids[cut:], positions=step.positions[cut:], out_slots=step.out_slots[cut:],
        req_rows=step.req_rows[i:],
        seq_lens=step.seq_lens[i:],
        prefix_lens=[step.prefix_lens[i] + inside] + step.prefix_lens[i + 1:],
        all_logits=step.all_logits,
    )
    return TwoBatchSplit(first, second, cut_request=inside > 0)


def forward_two_batch(model: CausalLM, tp: TPContext, a: ForwardBatch, b: ForwardBatch,
                      cut_request: bool = False) -> torch.Tensor:
    """Logits of A's requests then B's (as one step's forward would give them), with each all-reduce
    overlapped with the other micro-batch's next stage. ``cut_request``: A's last request continues in
    B, so its row in A's logits is dropped (kept with all_logits: every token has its row)."""
    decoder = model.model
    hidden_a, rope_a = decoder.embed(a)
    hidden_b, rope_b = decoder.embed(b)
    residual_a: torch.Tensor | None = None
    residual_b: torch.Tensor | None = None
    pending_a: WorkHandle | None = None  # A's / B's MLP all-reduce of the layer before
    pending_b: WorkHandle | None = None
    for layer in decoder.decoder_layers():
        if pending_a is not None:
            pending_a.wait()
        attn_a, residual_a = layer.attention_stage(rope_a, hidden_a, residual_a, a)
        work_a = tp.all_reduce_start(attn_a)
        if pending_b is not None:
            pending_b.wait()
        attn_b, residual_b = layer.attention_stage(rope_b, hidden_b, residual_b, b)
        work_b = tp.all_reduce_start(attn_b)
        work_a.wait()
        hidden_a, residual_a = layer.mlp_stage(attn_a, residual_a)
        pending_a = tp.all_reduce_start(hidden_a)
        work_b.wait()
        hidden_b, residual_b = layer.mlp_stage(attn_b, residual_b)
        pending_b = tp.all_reduce_start(hidden_b)
    assert pending_a is not None and pending_b is not None, "a decoder needs at least one layer"
    assert residual_a is not None and residual_b is not None
    pending_a.wait()
    pending_b.wait()
    rows_a = model.logit_rows(decoder.finish(hidden_a, residual_a), a)
    if cut_request and not a.all_logits:
        rows_a = rows_a[:-1]
    rows_b = model.logit_rows(decoder.finish(hidden_b, residual_b), b)
    # One LM-head GEMM over both halves' rows: its weight (the largest) is read once, and each row is
    # computed in the same GEMM as without the split.
    return model.lm_head.logits(torch.cat([rows_a, rows_b]))  # [batch (or tokens), vocab]
