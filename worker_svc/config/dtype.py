"""The torch dtype the engine runs in: ``--dtype`` (``auto`` reads the checkpoint's ``torch_dtype``),
adjusted for what the device runs fast."""

from __future__ import annotations

import structlog
import torch

from worker_svc.config.model_config import ModelConfig

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    name = config.torch_dtype if requested == "auto" else requested
    dtype = _DTYPES.get(name.replace("torch.", ""), torch.float32)
    if dtype is torch.float16 and device.type == "cpu":
        # fp16 matmuls have no fast CPU path; bf16 keeps the range and is fast on AVX-512-BF16.
        log.info("float16 requested on CPU; using bfloat16")
        dtype = torch.bfloat16
    return dtype
