"""What the engine needs of a model runner: run one step, and the facts it schedules by (the configs,
the device, the context length, the KV cache it does its accounting on). ``ModelRunner`` is one; the
tensor-parallel leader's ``LeaderRunner`` (broadcast, then run locally) is another."""

from __future__ import annotations

from typing import Protocol

import torch

from worker_svc.config.engine_config import EngineConfig
from worker_svc.config.model_config import ModelConfig
from worker_svc.executor.kernel_choice import KernelPlan
from worker_svc.forward_batch import StepInput
from worker_svc.kvcache import KVCache
from worker_svc.parallel.context import TPContext


class StepRunner(Protocol):
    @property
    def engine_config(self) -> EngineConfig: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def tp(self) -> TPContext:
        """This rank's place in the tensor-parallel group (rank 0 of 1 without TP)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def context_len(self) -> int:
        """The longest sequence (prompt + output) a request may reach."""

    @property
    def kv(self) -> KVCache:
        """This rank's KV cache; the scheduler allocates and frees its slots."""

    @property
    def weight_nbytes(self) -> int:
        """Bytes the weights take on this rank, measured after packing and quantization."""

    @property
    def kernels(self) -> KernelPlan:
        """The kernels this rank's model runs (chosen at load, executor/kernel_choice.py)."""

    @property
    def torch_compile(self) -> str:
        """"on" where decode steps run compiled (executor/compiled_decode.py), else "off: <why>"."""

    @property
    def fused_layers_state(self) -> str:
        """"on" where decode (and extend) steps run as one C++ call over the layers (executor/fused_layers.py), else
        "off: <why>"."""

    def forward(self, step: StepInput) -> torch.Tensor:
        """Run one step; float32 logits [batch, vocab] at each request's final token, or
        [tokens, vocab] at every new token when ``step.all_logits``."""
