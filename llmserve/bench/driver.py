"""Drive a ModelRunner directly (no scheduler), as sglang's bench_one_batch does: prefill a static
batch, extend it, decode it greedily. Used by ``llmserve bench-one-batch`` and the oracle tests."""

from __future__ import annotations

import torch

from worker_svc.forward_batch import ForwardMode
from worker_svc.runner import ModelRunner, StepInput


class StaticBatch:
    def __init__(self, runner: ModelRunner, batch_size: int) -> None:
        self.runner = runner
        runner.allocator.clear()
        self.rows = []
        for _ in range(batch_size):
            row = runner.req_table.alloc()
            if row is None:
                raise ValueError(f"batch size {batch_size} exceeds --max-running-requests")
            self.rows.append(row)
        self.seq_lens = [0] * batch_size

    def release(self) -> None:
        for row in self.rows:
            self.runner.req_table.free(row)
        self.runner.allocator.clear()

    def extend(self, pieces: list[list[int]]) -> torch.Tensor:
        """Append ``pieces[i]`` to request i (prefill when it has no cache yet); returns last-token logits."""
        ids = [t for piece in pieces for t in piece]
        positions = [p for piece, start in zip(pieces, self.seq_lens) for p in range(start, start + len(piece))]
        return self._step(ForwardMode.EXTEND, ids, positions, [len(p) for p in pieces])

    def decode(self, token_ids: torch.Tensor) -> torch.Tensor:
        positions = list(self.seq_lens)
        return self._step(ForwardMode.DECODE, token_ids, positions, [1] * len(self.rows))

    def _step(self, mode: ForwardMode, ids, positions: list[int], counts: list[int]) -> torch.Tensor:
        slots = self.runner.allocator.alloc(len(positions))
        if slots is None:
            raise RuntimeError("KV pool exhausted: raise --max-total-tokens")
        prefix = list(self.seq_lens)
        self.seq_lens = [s + c for s, c in zip(self.seq_lens, counts)]
        step = StepInput(
            mode=mode,
            input_ids=torch.as_tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_slots=slots,
            req_rows=torch.tensor(self.rows, dtype=torch.int64),
            seq_lens=list(self.seq_lens),
            prefix_lens=prefix,
        )
        return self.runner.forward(step)


def greedy_with_split_prefill(
    runner: ModelRunner, prompts: list[list[int]], output_len: int, cut_len: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill the first ``cut_len`` tokens of each prompt, extend the rest on top of that cached
    prefix, then decode ``output_len`` tokens greedily. Returns (final prefill logits [B, V], outputs)."""
    batch = StaticBatch(runner, len(prompts))
    try:
        cuts = [min(cut_len, len(p) - 1) if len(p) > 1 else len(p) for p in prompts]
        batch.extend([p[:c] for p, c in zip(prompts, cuts)])
        logits = batch.extend([p[c:] for p, c in zip(prompts, cuts)]) if any(
            len(p) > c for p, c in zip(prompts, cuts)
        ) else None
        if logits is None:
            raise ValueError("every prompt needs at least two tokens")
        prefill_logits = logits.clone()
        outputs: list[list[int]] = [[] for _ in prompts]
        for step in range(output_len):
            next_ids = logits.argmax(dim=-1)
            for out, token in zip(outputs, next_ids.tolist()):
                out.append(token)
            if step + 1 < output_len:
                logits = batch.decode(next_ids)
        return prefill_logits, outputs
    finally:
        batch.release()
