"""Architecture name (config.json "architectures"[0]) -> model class."""

from __future__ import annotations

from collections.abc import Callable

from worker_svc.config.model_config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from worker_svc.models.decoder import CausalLM
from worker_svc.models.deepseek_v2 import DeepseekV2ForCausalLM
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.parallel.context import TPContext

ModelClass = Callable[[ModelConfig, TPContext], CausalLM]

_MODELS: dict[str, ModelClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
}


def model_class(architecture: str) -> ModelClass:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ConfigError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
