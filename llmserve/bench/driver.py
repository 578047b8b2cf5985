"""Drive a runner directly (no scheduler), as sglang's bench_one_batch does: prefill a static batch,
extend it, decode it greedily, doing the KV slot bookkeeping on the runner's ``KVCache`` itself. Used
by ``llmserve bench-one-batch`` and the oracle tests."""

from __future__ import annotations

import torch

from worker_svc.executor.step_runner import StepRunner
from worker_svc.forward_batch import ForwardMode, StepInput


class StaticBatch:
    def __init__(self, runner: StepRunner, batch_size: int) -> None:
        self.runner = runner
        self.kv = runner.kv
        self.kv.allocator.clear()
        self.rows: list[int] = []
        for _ in range(batch_size):
            row = self.kv.req_table.alloc()
            if row is None:
                raise ValueError(f"batch size {batch_size} exceeds --max-running-requests")
            self.rows.append(row)
        self.seq_lens = [0] * batch_size

    def release(self) -> None:
        for row in self.rows:
            self.kv.req_table.free(row)
        self.kv.allocator.clear()

    def extend(self, pieces: list[list[int]], only: list[int] | None = None, all_logits: bool = False) -> torch.Tensor:
        """Append ``pieces[j]`` to request ``only[j]`` (default: every request, in order; prefill
        when it has no cache yet). Returns last-token logits, one row per extended request, or with
        ``all_logits`` one row per appended token (packed in request order)."""
        rows = list(range(len(self.rows))) if only is None else only
        ids = [t for piece in pieces for t in piece]
        positions = [
            p
            for piece, i in zip(pieces, rows, strict=True)
            for p in range(self.seq_lens[i], self.seq_lens[i] + len(piece))
        ]
        return self._step(ForwardMode.EXTEND, ids, positions, [len(p) for p in pieces], rows, all_logits)

    def prefill_in_chunks(self, prompts: list[list[int]], chunk: int) -> torch.Tensor:
        """Prefill request i with ``prompts[i]``, ``chunk`` tokens per step (prompts already done sit
        later steps out); returns each prompt's final-token logits [B, V]."""
        final: list[torch.Tensor | None] = [None] * len(prompts)
        for start in range(0, max(len(p) for p in prompts), chunk):
            live = [i for i, p in enumerate(prompts) if start < len(p)]
            logits = self.extend([prompts[i][start : start + chunk] for i in live], only=live)
            for j, i in enumerate(live):
                if start + chunk >= len(prompts[i]):
                    final[i] = logits[j]
        done = [f for f in final if f is not None]
        assert len(done) == len(final), "every prompt ends in some chunk"
        return torch.stack(done)

    def decode(self, token_ids: torch.Tensor) -> torch.Tensor:
        positions = list(self.seq_lens)
        everyone = list(range(len(self.rows)))
        return self._step(ForwardMode.DECODE, token_ids, positions, [1] * len(self.rows), everyone)

    def _step(
        self,
        mode: ForwardMode,
        ids,
        positions: list[int],
        counts: list[int],
        which: list[int],
        all_logits: bool = False,
    ) -> torch.Tensor:
        slots = self.kv.allocator.alloc(len(positions))
        if slots is None:
            raise RuntimeError("KV pool exhausted: raise --max-total-tokens")
        prefix = [self.seq_lens[i] for i in which]
        for i, count in zip(which, counts, strict=True):
            self.seq_lens[i] += count
        step = StepInput(
            mode=mode,
            input_ids=torch.as_tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_slots=slots,
            req_rows=torch.tensor([self.rows[i] for i in which], dtype=torch.int64),
            seq_lens=[self.seq_lens[i] for i in which],
            prefix_lens=prefix,
            all_logits=all_logits,
        )
        return self.runner.forward(step)


def chunked_prefill_logits(runner: StepRunner, prompts: list[list[int]], chunk: int) -> torch.Tensor:
    """Prefill every prompt ``chunk`` tokens per step (prompts already done sit later steps out);
    returns each prompt's final-token logits [B, V]."""
    batch = StaticBatch(runner, len(prompts))
    try:
        return batch.prefill_in_chunks(prompts, chunk)
    finally:
        batch.release()


def greedy_with_split_prefill(
    runner: StepRunner, prompts: list[list[int]], output_len: int, cut_len: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill the first ``cut_len`` tokens of each prompt, extend the rest on top of that cached
    prefix, then decode ``output_len`` tokens greedily. Returns (final prefill logits [B, V], outputs)."""
    batch = StaticBatch(runner, len(prompts))
    try:
        cuts = [min(cut_len, len(p) - 1) if len(p) > 1 else len(p) for p in prompts]
        batch.extend([p[:c] for p, c in zip(prompts, cuts, strict=True)])
        logits = (
            batch.extend([p[c:] for p, c in zip(prompts, cuts, strict=True)])
            if any(len(p) > c for p, c in zip(prompts, cuts, strict=True))
            else None
        )
        if logits is None:
            raise ValueError("every prompt needs at least two tokens")
        prefill_logits = logits.clone()
        outputs: list[list[int]] = [[] for _ in prompts]
        for step in range(output_len):
            next_ids = logits.argmax(dim=-1)
            for out, token in zip(outputs, next_ids.tolist(), strict=True):
                out.append(token)
            if step + 1 < output_len:
                logits = batch.decode(next_ids)
        return prefill_logits, outputs
    finally:
        batch.release()
