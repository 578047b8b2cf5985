"""Time HF ``generate`` decode steps on the same folder, for interleaved A/B benchmarks."""

from __future__ import annotations

import time

import torch


class HFGenerateTimer:
    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.model.generation_config.eos_token_id = None
        self.vocab = self.model.config.vocab_size

    def _generate(self, ids: torch.Tensor, new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        return time.perf_counter() - start

    def decode_step_latency(self, batch_size: int, input_len: int, output_len: int) -> float:
        """Mean seconds per decode step: (generate(output_len) - generate(1)) / (output_len - 1)."""
        ids = torch.randint(0, self.vocab, (batch_size, input_len), generator=torch.Generator().manual_seed(0))
        prefill_only = self._generate(ids, 1)
        full = self._generate(ids, output_len)
        return (full - prefill_only) / max(1, output_len - 1)
