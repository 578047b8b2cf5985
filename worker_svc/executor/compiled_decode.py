"""torch.compile of the decode forward on the CPU (``--enable-torch-compile``, ``--torch-compile-max-bs``),
as vLLM's CPU backend and sglang's ``--enable-torch-compile`` do.

Why: a batch-1 decode step of SmolLM2-135M is ~250 small kernel calls, and run eagerly the Python between
them (module calls, attribute lookups, argument parsing) costs about as much as the int4 linears
themselves (docs/engine.md, "Compiled decode on the CPU"). Inductor traces the decoder (embedding, every layer,
the final norm) into one graph whose wrapper, C++ here (``cpp_wrapper``), calls the kernels back to back,
and it fuses the small elementwise ops between them (silu * up, the KV store).

What runs compiled: ``DecoderModel.forward`` of DECODE steps of up to ``torch_compile_max_bs`` requests,
with the number of tokens and the context length symbolic; the LM head and the logits gather stay eager
(they index with the host's batch size). Extend steps, larger decodes and all-logits scoring run eagerly.
Numbers: inductor computes fused elementwise chains in float32 and rounds once, where eager rounds each
op's result; ``emulate_precision_casts`` makes it round where eager does, so compiled and eager decode
give the same logits (tests/unit/test_compiled_decode.py).

Compiled at start on dummy decodes that write only KV slot 0 (the allocator's padding slot) from request
row 0, so no request ever waits on a compile: one request (dynamo specializes a dimension of size 1) and
two requests (the batch dimension symbolic), each at two context lengths, with and without a length
mask. Inductor caches what it built (``TORCHINDUCTOR_CACHE_DIR``, default /tmp/torchinductor_<user>):
measured on 2 cores, 145 s with an empty cache, 38 s with it warm (dynamo still traces).

Off, with the reason logged (``compile_plan``): not the CPU (CUDA graphs hold the decode there), tensor
parallelism (each layer's all-reduce is host code between the layers), MoE experts run as a loop (a host
sync per layer). When tracing fails anyway (an op dynamo cannot follow), the worker logs why and decodes
eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from worker_svc.attention.base import StepAttentionBackend
from worker_svc.config.engine_config import EngineConfig
from worker_svc.forward_batch import ForwardBatch, ForwardMode, StepInput
from worker_svc.kvcache import KVCache
from worker_svc.layers.moe import DeepseekMoE
from worker_svc.models.decoder import CausalLM
from worker_svc.parallel.context import TPContext

log = structlog.get_logger(__name__)

# Inductor settings for the decode graph: a C++ wrapper (no Python between the kernels), no per-call
# checks of the kernels' output shapes, and eager's rounding of low-precision intermediates.
INDUCTOR_OPTIONS: dict[str, Any] = {
    "cpp_wrapper": True,
    "size_asserts": False,
    "alignment_asserts": False,
    "emulate_precision_casts": True,
}

# Dummy decodes run at start: (context length of each request). Lengths differ between calls so each
# dimension dynamo sees change is made symbolic, and from the symbols of the other dimensions (no size
# coincidence it would guard on); the unequal pair builds the length mask of a mixed batch.
WARM_UP_LENGTHS: tuple[tuple[int, ...], ...] = ((3,), (7,), (5, 5), (6, 4))


@dataclass(frozen=True)
class CompilePlan:
    enabled: bool
    reason: str  # why not, when disabled
    max_bs: int = 0


def compile_plan(engine_config: EngineConfig, device: torch.device, tp: TPContext,
                 model: torch.nn.Module) -> CompilePlan:
    def off(reason: str) -> CompilePlan:
        return CompilePlan(enabled=False, reason=reason)

    if not engine_config.enable_torch_compile:
        return off("--enable-torch-compile not given")
    if device.type != "cpu":
        return off(f"device {device.type}: torch.compile of decode is for the CPU (CUDA graphs hold decode on CUDA)")
    if tp.size > 1:
        return off("tensor parallelism: each layer's all-reduce is host code between the layers")
    if not isinstance(model, CausalLM):
        return off(f"{type(model).__name__} is not a decoder model (models/decoder.py CausalLM)")
    if any(isinstance(m, DeepseekMoE) and m.grouped is None for m in model.modules()):
        return off("MoE experts run as a loop with a host sync per layer")
    max_bs = min(engine_config.torch_compile_max_bs, engine_config.max_running_requests)
    return CompilePlan(enabled=True, reason="", max_bs=max_bs)


class CompiledDecode:
    """Runs decode steps of up to ``max_bs`` requests through the compiled decoder (``forward``).

    After the warm-up the graphs are final: the model, its weights and the KV pool never change, and
    steps differ only in the dimensions compiled symbolic. So a step evaluates only the guards that tell
    the graphs apart (dynamo's ``skip_guard_eval_unsafe`` stance), not the ~1 ms of guards over every
    weight that would otherwise run per step. Should a step still need a new graph, dynamo refuses it:
    that step and every later one run eagerly, with a warning, instead of compiling mid-serving.
    """

    def __init__(self, model: CausalLM, kv: KVCache, backend: StepAttentionBackend, max_bs: int) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.max_bs = max_bs
        self.steps_run = 0
        self.failed: str | None = None  # why compiled steps stopped, once they did
        self._decoder = torch.compile(model.model.forward, fullgraph=True, dynamic=True, options=INDUCTOR_OPTIONS)

    def accepts(self, step: StepInput) -> bool:
        return (self.failed is None and step.mode is ForwardMode.DECODE and not step.all_logits
                and 0 < len(step.seq_lens) <= self.max_bs)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """A prepared decode batch -> float32 logits [batch, vocab]. Runs in inference mode (as ModelRunner's)."""
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                hidden = self._decoder(_step_tensors(batch))  # [batch, hidden]
        except RuntimeError as exc:
            if "skip_guard_eval_unsafe" not in str(exc):
                raise
            # Refused before the graph ran: nothing of the step happened yet.
            self.failed = "a decode step needed a graph the warm-up did not compile"
            log.warning("torch compile off", reason=self.failed, batch_size=batch.batch_size)
            hidden = self.model.model(batch)
        else:
            self.steps_run += 1
        return self.model.logits(hidden, batch)

    def warm_up(self) -> float:
        """Compile every graph decode steps will use (``WARM_UP_LENGTHS``); -> seconds. Writes only the
        padding slot. Raises what tracing raised."""
        start = time.perf_counter()
        table = self.kv.req_table.table
        for lengths in WARM_UP_LENGTHS:
            if len(lengths) > self.max_bs:
                continue
            zeros = torch.zeros(len(lengths), dtype=torch.int64, device=table.device)
            # Row 0's first entries: whatever they hold is only read, and the step writes slot 0.
            batch = ForwardBatch(
                mode=ForwardMode.DECODE, input_ids=zeros, positions=torch.tensor(lengths, device=table.device) - 1,
                out_slots=zeros.clone(), req_rows=zeros.clone(), seq_lens=list(lengths),
                prefix_lens=[n - 1 for n in lengths], req_to_token=table, kv_pool=self.kv.pool,
                attn_backend=self.backend,
            )
            with torch.inference_mode(), _symbolic_without_duck_sizes():
                self.backend.prepare(batch)
                self._decoder(_step_tensors(batch))
        return time.perf_counter() - start


def _step_tensors(batch: ForwardBatch) -> ForwardBatch:
    """The batch, its step inputs made ordinary tensors where they are inference tensors. Dynamo guards on
    a tensor's dispatch keys, which differ between the two kinds: steps built in inference mode and steps
    built outside it would each need their own graphs, compiled in the middle of serving. ([batch] int64:
    a copy is cheap.)"""
    for name in ("input_ids", "positions", "out_slots"):
        tensor = getattr(batch, name)
        if tensor.is_inference():
            with torch.inference_mode(False):
                setattr(batch, name, tensor.clone())
    return batch


def _symbolic_without_duck_sizes() -> Any:
    """Dynamo gives dimensions of equal size one symbol and guards on the equality ("duck sizing"): a size
    that happened to match another at compile time (a storage offset and a stride, say) would recompile
    in the middle of serving. Off while the warm-up compiles."""
    from torch.fx.experimental import _config as fx_config

    return fx_config.patch(use_duck_shape=False)  # type: ignore[attr-defined]  # installed by install_config_module


def build_compiled_decode(engine_config: EngineConfig, model: torch.nn.Module, tp: TPContext, kv: KVCache,
                          backend: StepAttentionBackend, device: torch.device) -> tuple[CompiledDecode | None, str]:
    """The compiled decode, warmed up, or None and why not."""
    plan = compile_plan(engine_config, device, tp, model)
    if not plan.enabled:
        log.info("torch compile off", reason=plan.reason)
        return None, plan.reason
    assert isinstance(model, CausalLM)
    compiled = CompiledDecode(model, kv, backend, plan.max_bs)
    try:
        seconds = compiled.warm_up()
    except Exception as exc:  # tracing or compiling failed: decode eagerly, and say why
        reason = f"compiling failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.warning("torch compile off", reason=reason)
        return None, reason
    log.info("torch compile ready", max_bs=plan.max_bs, seconds=round(seconds, 1))
    return compiled, ""
