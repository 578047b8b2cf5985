"""How close a decode step's linears come to the host's memory read bandwidth (issue 15, acceptance 2).

Loads the model as the worker would (same kernel plan, same quantization), then replays one bs1 decode
step's linears, in the model's order, with one-row inputs: the weight bytes they read divided by their
time is their effective bandwidth. Twice: each linear called from Python as the modules call it, and (where
fused decode is on, executor/fused_decode.py) the layers' linears as the fused step calls them, from C++
(``DecodeLayers.time_linears``), with the LM head from Python. The host's read bandwidth is measured in the
same process: the best of several fp32 sums over a buffer far larger than the caches, on the same threads.

    python benchmarks/linear_bandwidth.py MODEL [--quant none|int8wo|int4wo-32] [--bf16-linear K] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.layers.embedding import ParallelLMHead
from worker_svc.layers.linear import KernelLinear


def host_read_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    """GB/s: the best of ``repeats`` fp32 sums over ``gib`` GiB (aten's sum is vectorized and threaded)."""
    buffer = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    buffer.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def _weight_bytes(module: nn.Module) -> int:
    kernel = getattr(module, "kernel", None)
    nbytes = getattr(kernel, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    weight = module.weight
    return weight.numel() * weight.element_size()


def decode_linears(model: nn.Module) -> list[tuple[nn.Module, int, int]]:
    """(module, in_features, weight bytes) for every linear one decode step runs, LM head last."""
    linears = []
    for module in model.modules():
        if isinstance(module, KernelLinear):
            if module.weight.device.type == "meta" and not hasattr(module.kernel, "nbytes"):
                continue  # its weight lives in another kernel (grouped MoE experts): not run one by one
            linears.append((module, module.in_features, _weight_bytes(module)))
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    return linears + [(head, head.weight.shape[1], _weight_bytes(head)) for head in heads]


def linear_bandwidth(runner: ModelRunner, repeats: int = 20) -> dict[str, float]:
    linears = decode_linears(runner.model)
    inputs = [torch.randn(1, k).to(runner.dtype) for _, k, _ in linears]

    def step() -> None:
        for (module, _, _), x in zip(linears, inputs, strict=True):
            if isinstance(module, ParallelLMHead):
                module.kernel(x, module.weight, None)
            else:
                module(x)

    with torch.inference_mode():
        for _ in range(3):
            step()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - start)
    nbytes = sum(b for _, _, b in linears)
    result = {"linears": len(linears), "weight_bytes": nbytes, "linears_ms": best * 1e3,
              "linears_gbs": nbytes / best / 1e9}
    fused = runner.fused_decode
    if fused is not None:  # the layers' linears as the fused step calls them (from C++), the LM head from Python
        heads = [(m, x) for (m, _, _), x in zip(linears, inputs, strict=True) if isinstance(m, ParallelLMHead)]
        with torch.inference_mode():
            layers_s = fused.layers.time_linears(1, repeats, torch.empty(0, dtype=runner.dtype))
            head_s = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for head, x in heads:
                    head.kernel(x, head.weight, None)
                head_s = min(head_s, time.perf_counter() - start)
        result["fused_linears_ms"] = (layers_s + head_s) * 1e3
        result["fused_linears_gbs"] = nbytes / (layers_s + head_s) / 1e9
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--quant", default="none", help="--torchao-config of the run (the LM head is quantized too)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bf16-linear", default="auto", help="--cpu-bf16-linear of the run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(EngineConfig(model_path=args.model, dtype=args.dtype, torchao_config=args.quant,
                                      quantize_lm_head=args.quant != "none", max_total_tokens=256,
                                      cpu_bf16_linear=args.bf16_linear))
    result = linear_bandwidth(runner)
    result["host_read_gbs"] = host_read_bandwidth()
    result["fraction_of_host"] = result["linears_gbs"] / result["host_read_gbs"]
    if "fused_linears_gbs" in result:
        result["fused_fraction_of_host"] = result["fused_linears_gbs"] / result["host_read_gbs"]
    result["bf16_linear"] = runner.kernels.bf16_linear
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['linears']} linears, {result['weight_bytes'] / 1e6:.1f} MB read per bs1 step in "
          f"{result['linears_ms']:.2f} ms: {result['linears_gbs']:.1f} GB/s = {result['fraction_of_host']:.0%} of the "
          f"host's {result['host_read_gbs']:.1f} GB/s read bandwidth (bf16 kernel {result['bf16_linear']}), each "
          "called from Python")
    if "fused_linears_gbs" in result:
        print(f"as the fused decode step calls them: {result['fused_linears_ms']:.2f} ms, "
              f"{result['fused_linears_gbs']:.1f} GB/s = {result['fused_fraction_of_host']:.0%}")


if __name__ == "__main__":
    main()
