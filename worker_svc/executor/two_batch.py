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
the LM head's gather stay synchronous.

The split is a pure function of the StepInput and the engine config, so every TP rank splits the
broadcast step the same way with no protocol change. It cuts between whole requests, choosing the cut
that best balances the two halves' cost (tokens for the linear layers plus tokens x context for
attention: uneven halves lose the gain, sglang #6328). Steps under ``--tbo-min-tokens`` tokens, or of
a single request, are not split.
"""

from __future__ import annotations

import torch

from worker_svc.forward_batch import ForwardBatch, StepInput
from worker_svc.models.decoder import CausalLM
from worker_svc.parallel.collective_observer import WorkHandle
from worker_svc.parallel.context import TPContext

# Attention cost per (query token x context token) relative to the linear layers' cost per token.
ATTENTION_WEIGHT = 1.0 / 2048


def split_step(step: StepInput, min_tokens: int) -> tuple[StepInput, StepInput] | None:
    """The step as two micro-batches of whole requests (A first, then B, in the step's order), or
    None when it is too small to split."""
    batch = int(step.req_rows.numel())
    tokens = int(step.input_ids.numel())
    if batch < 2 or tokens < min_tokens:
        return None
    extend = [seq - prefix for seq, prefix in zip(step.seq_lens, step.prefix_lens, strict=True)]
    costs = [n + ATTENTION_WEIGHT * n * seq for n, seq in zip(extend, step.seq_lens, strict=True)]
    total = sum(costs)
    best_cut, best_gap, running = 1, float("inf"), 0.0
    for cut in range(1, batch):
        running += costs[cut - 1]
        gap = abs(total - 2 * running)
        if gap < best_gap:
            best_cut, best_gap = cut, gap
    cut_tokens = sum(extend[:best_cut])
    return _slice(step, 0, best_cut, 0, cut_tokens), _slice(step, best_cut, batch, cut_tokens, tokens)


def _slice(step: StepInput, r0: int, r1: int, t0: int, t1: int) -> StepInput:
    return StepInput(
        mode=step.mode,
        input_ids=step.input_ids[t0:t1],
        positions=step.positions[t0:t1],
        out_slots=step.out_slots[t0:t1],
        req_rows=step.req_rows[r0:r1],
        seq_lens=step.seq_lens[r0:r1],
        prefix_lens=step.prefix_lens[r0:r1],
        all_logits=step.all_logits,
    )


def forward_two_batch(model: CausalLM, tp: TPContext, a: ForwardBatch, b: ForwardBatch) -> torch.Tensor:
    """Logits of A's requests then B's (as one step's forward would give them), with each all-reduce
    overlapped with the other micro-batch's next stage."""
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
    logits_a = model.logits(decoder.finish(hidden_a, residual_a), a)
    logits_b = model.logits(decoder.finish(hidden_b, residual_b), b)
    return torch.cat([logits_a, logits_b])  # [batch (or tokens), vocab]
