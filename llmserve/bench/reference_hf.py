"""HF transformers as the correctness oracle (sglang's scripts/playground/reference_hf.py)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(
    model_dir: str | Path, prompts: list[list[int]], output_len: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, list[list[int]]]:
    """Final-position prefill logits [B, V] (float32) and ``output_len`` greedy tokens per prompt,
    one prompt at a time (no padding), EOS disabled so every prompt yields exactly output_len tokens."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - transformers is a test/bench dependency
        raise RuntimeError("--correct needs HF transformers: pip install 'llmserve[test]'") from exc
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    logits, outputs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logits.append(model(ids).logits[0, -1].float())
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt):].tolist())
    return torch.stack(logits), outputs
