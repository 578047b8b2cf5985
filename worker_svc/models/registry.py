"""Architecture name (config.json "architectures"[0]) -> model class."""

from __future__ import annotations

from torch import nn

from worker_svc.config.model_config import SUPPORTED_ARCHITECTURES, ConfigError
from worker_svc.models.deepseek_v2 import DeepseekV2ForCausalLM
from worker_svc.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ConfigError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
