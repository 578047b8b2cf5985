"""Engine command-line flags, shared by `bench-one-batch`, `worker` and `serve`, parsed once into an
EngineConfig at the edge."""

from __future__ import annotations

import argparse
import json
from typing import Any

import structlog

from worker_svc.config.engine_config import (
    CPU_BF16_LINEAR_KERNELS,
    CPU_QUANT_KERNELS,
    DTYPES,
    MLA_DECODE_MODES,
    MOE_EXPERT_KERNELS,
    PREFILL_BATCHING,
    EngineConfig,
)
from worker_svc.executor.native_memory import MAX_MMAP_THRESHOLD, HeapPolicy, apply_heap_policy, parse_heap_policy

log = structlog.get_logger(__name__)


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", "--model-path", dest="model", required=True, help="HF-format model folder")
    g.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: the checkpoint's torch_dtype")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    g.add_argument("--kv-cache-memory-mb", type=int, default=1024,
                   help="KV pool memory budget when --max-total-tokens is not given")
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument("--chunked-prefill-size", type=int, default=512,
                   help="longest piece of one prompt prefilled in a step (default 512)")
    g.add_argument("--max-prefill-tokens", type=int, default=512,
                   help="new tokens per extend step across all requests (default 512: a burst of prompts is "
                   "prefilled over several steps, the first ones decoding sooner)")
    g.add_argument("--prefill-batching", choices=PREFILL_BATCHING, default="cost",
                   help="how many waiting requests an extend step admits: cost (default: the split of the queue "
                   "into steps that makes the requests' summed time to first token least, from a model of step "
                   "time fitted to the steps just run) or budget (all that fits --max-prefill-tokens)")
    g.add_argument("--context-length", type=int, default=None)
    g.add_argument("--json-model-override-args", type=json_object, default={}, metavar="JSON",
                   help='override config.json fields, e.g. \'{"rope_theta": 10000}\'')
    g.add_argument("--random-seed", type=int, default=0)
    g.add_argument("--disable-radix-cache", action="store_true",
                   help="no radix prefix cache: every request computes its whole prompt, KV is freed when it finishes")
    g.add_argument("--torchao-config", "--quantization", dest="torchao_config", default="none",
                   help="weight quantization: none, int8wo, int4wo-<32|64|128|256>, int8dq, fp8wo, fp8dq-per_row")
    g.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too")
    g.add_argument("--cpu-quant-kernel", choices=CPU_QUANT_KERNELS, default="auto",
                   help="kernels for quantized layers on the CPU (auto: this project's AVX-512 kernels on AVX-512 "
                   "CPUs, its AVX2 kernels on AVX2-only CPUs, else aten's)")
    g.add_argument("--cpu-bf16-linear", choices=CPU_BF16_LINEAR_KERNELS, default="auto",
                   help="bf16 matmul kernel on the CPU (auto: amx_bf16 with AMX-BF16, avx512_bf16 with AVX512-BF16, "
                   "fbgemm_fp16 on CPUs without native bf16, else aten)")
    g.add_argument("--mla-decode", choices=MLA_DECODE_MODES, default="absorbed",
                   help="MLA (DeepSeek-V2) decode: attend over cached latents with W_UK/W_UV absorbed, "
                   "or decompress them (normal)")
    g.add_argument("--moe-experts", choices=MOE_EXPERT_KERNELS, default="auto",
                   help="MoE routed experts: a loop over experts, or grouped GEMMs with no host sync "
                   "(auto: grouped on CUDA without quantization)")
    g.add_argument("--enable-deterministic-inference", action="store_true",
                   help="a request's outputs do not depend on the other requests in its step (batch-invariant "
                   "fp32 linears, attention row by row, MoE loop); slower prefill")
    g.add_argument("--enable-two-batch-overlap", action="store_true",
                   help="run large steps as two micro-batches, each one's tensor-parallel all-reduce "
                   "overlapping the other's compute")
    g.add_argument("--tbo-min-tokens", type=int, default=1024, metavar="N",
                   help="--enable-two-batch-overlap: split only steps of at least N tokens (default 1024: on "
                   "the CPU a split decode reads every weight twice, docs/benchmarks.md)")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs (graphs are "
                   "on by default on CUDA, never used on the CPU)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=None, metavar="N",
                   help="CUDA graphs: capture decode batch sizes 1, 2, 4, 8, 16, 24, ... up to N (default "
                   "--max-running-requests); larger decode batches run eagerly")
    g.add_argument("--enable-torch-compile", action="store_true",
                   help="CPU: compile the decode forward with torch.compile (inductor) at start, so decode "
                   "steps run without Python between the kernels; start takes longer (cached afterwards)")
    g.add_argument("--torch-compile-max-bs", type=int, default=32, metavar="N",
                   help="--enable-torch-compile: decode steps of up to N requests run compiled (default 32); "
                   "larger ones and prefill run eagerly")
    g.add_argument("--compute-nice", type=int, default=0, metavar="N",
                   help="Linux: run the step thread and its OpenMP team at nice N (0..19, default 0: unchanged), "
                   "so the worker's gRPC thread and a router, tokenizer or client sharing its cores get a core "
                   "at once instead of waiting for the forward (first-token latency on shared cores)")
    g.add_argument("--disable-fused-layers", "--disable-fused-decode", action="store_true",
                   help="CPU: run decode and extend steps layer by layer from Python instead of one C++ call over "
                   "the layers (same kernels, same logits; for A/B runs). --disable-fused-decode: its former name")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_path=args.model,
        dtype=args.dtype,
        device=args.device,
        max_total_tokens=args.max_total_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_mb << 20,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        prefill_batching=getattr(args, "prefill_batching", "cost"),
        context_length=args.context_length,
        json_model_override_args=args.json_model_override_args,
        random_seed=args.random_seed,
        disable_radix_cache=getattr(args, "disable_radix_cache", False),
        cpu_bf16_linear=args.cpu_bf16_linear,
        torchao_config=args.torchao_config,
        quantize_lm_head=args.quantize_lm_head,
        cpu_quant_kernel=args.cpu_quant_kernel,
        mla_decode=getattr(args, "mla_decode", "absorbed"),
        moe_experts=getattr(args, "moe_experts", "auto"),
        deterministic_inference=getattr(args, "enable_deterministic_inference", False),
        enable_two_batch_overlap=getattr(args, "enable_two_batch_overlap", False),
        tbo_min_tokens=getattr(args, "tbo_min_tokens", 1024),
        disable_cuda_graph=getattr(args, "disable_cuda_graph", False),
        cuda_graph_max_bs=getattr(args, "cuda_graph_max_bs", None),
        enable_torch_compile=getattr(args, "enable_torch_compile", False),
        torch_compile_max_bs=getattr(args, "torch_compile_max_bs", 32),
        disable_fused_layers=getattr(args, "disable_fused_layers", False),
        compute_nice=getattr(args, "compute_nice", 0),
    )


def engine_argv(args: argparse.Namespace, include_model: bool = False) -> list[str]:
    """The engine flags of parsed ``args`` as a command line again, to start another process (a TP
    rank, a worker under `serve`) with exactly the same engine. Walks the declared flags, so a new
    flag can never be forgotten; values equal to their default are left out."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    argv: list[str] = []
    for action in probe._actions:  # noqa: SLF001 - argparse keeps no public list of actions
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if action.dest == "model":
            if include_model:
                argv += ["--model", str(value)]
            continue
        if value == action.default:
            continue
        flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            argv.append(flag)
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def _heap_policy_arg(text: str) -> HeapPolicy:
    try:
        return parse_heap_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"keep, glibc or 1..{MAX_MMAP_THRESHOLD} bytes ({exc})") from None


def add_heap_policy_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--malloc-mmap-threshold: the process's native-heap policy (worker and bench-one-batch, whose steps should
    allocate as the worker's do)."""
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=_heap_policy_arg,
        default="keep",
        metavar="keep|glibc|BYTES",
        help="what glibc does with the large temporaries an engine step frees "
        "(worker_svc/executor/native_memory.py). keep (default): they stay in the heap for the next steps, "
        "no page faults per step, RSS levels off at a step's high-water mark. glibc: the C library's "
        "self-raising threshold and trimming (a prefill step pays tens of thousands of page faults). "
        "BYTES (at most 32 MiB, e.g. 4194304): temporaries above it go back to the kernel when freed, so "
        "RSS stays flat under traffic of changing shapes, at the cost of system CPU time",
    )


def apply_heap_policy_logged(policy: HeapPolicy) -> None:
    """Before the model loads: set the native-heap policy, and say so."""
    if apply_heap_policy(policy):
        log.info("native heap policy", malloc_mmap_threshold=policy)
    else:
        log.warning("--malloc-mmap-threshold not applied (not glibc)", malloc_mmap_threshold=policy)
