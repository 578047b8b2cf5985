"""How close a decode step's linears come to the host's memory read bandwidth (issue 15, acceptance 2).

Loads the model as the worker would (same kernel plan, same quantization), then replays one bs1 decode
step's linears, in the model's order, with one-row inputs: the weight bytes they read divided by their
time is their effective bandwidth. Twice: each linear called from Python as the modules call it, and (where
the fused layers are on, executor/fused_layers.py) the layers' linears as the fused step calls them, from C++
(``FusedLayers.time_linears``), with the LM head from Python. The host's read bandwidth is measured in the
same process, interleaved with the linears round by round: fp32 sums over a buffer far larger than the
caches, on the same threads. Each round's ratio is taken and the median over rounds reported (this VM's
read bandwidth moves 27-48 GB/s within a minute with its neighbours' load).

    python benchmarks/linear_bandwidth.py MODEL [--quant none|int8wo|int4wo-32] [--bf16-linear K] [--threads 2]
        [--rounds 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.layers.embedding import ParallelLMHead
from worker_svc.layers.linear import KernelLinear


class ReadProbe:
    """The host's read bandwidth: fp32 sums over ``gib`` GiB (aten's sum is vectorized and threaded)."""

    def __init__(self, gib: float = 1.0) -> None:
        self.buffer = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
        self.buffer.sum()  # fault the pages in

    def gbs(self, repeats: int) -> float:
        """GB/s of the best of ``repeats`` sums."""
        return self.buffer.numel() * 4 / _best_seconds(self.buffer.sum, repeats) / 1e9


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


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


def linear_bandwidth(runner: ModelRunner, rounds: int = 9, repeats: int = 5) -> dict[str, Any]:
    """The linears' and the probe's bandwidth, interleaved: each round times the probe, then the linears
    called from Python, then (with the fused layers) as the fused step calls them, each the best of
    ``repeats``. A neighbour's load on the shared memory bus moves all three of a round alike, so a
    round's ratio is steadier than two figures taken seconds apart; the medians are reported."""
    linears = decode_linears(runner.model)
    inputs = [torch.randn(1, k).to(runner.dtype) for _, k, _ in linears]
    heads = [(m, x) for (m, _, _), x in zip(linears, inputs, strict=True) if isinstance(m, ParallelLMHead)]
    fused = runner.fused_layers

    def python_step() -> None:
        for (module, _, _), x in zip(linears, inputs, strict=True):
            if isinstance(module, ParallelLMHead):
                module.kernel(x, module.weight, None)
            else:
                module(x)

    def heads_step() -> None:
        for head, x in heads:
            head.kernel(x, head.weight, None)

    nbytes = sum(b for _, _, b in linears)
    probe = ReadProbe()
    per_round: list[dict[str, float]] = []
    with torch.inference_mode():
        for _ in range(3):
            python_step()
        for _ in range(rounds):
            r = {"host_read_gbs": probe.gbs(2), "linears_s": _best_seconds(python_step, repeats)}
            if fused is not None:  # the layers' linears from C++, the LM head from Python
                layers_s = fused.layers.time_linears(1, repeats, torch.empty(0, dtype=runner.dtype))
                r["fused_linears_s"] = layers_s + _best_seconds(heads_step, repeats)
            per_round.append(r)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in per_round)

    def shares(key: str) -> list[float]:  # per round: the linears' GB/s over the probe's
        return [nbytes / r[key] / 1e9 / r["host_read_gbs"] for r in per_round]

    result: dict[str, Any] = {
        "linears": len(linears), "weight_bytes": nbytes, "rounds": rounds,
        "host_read_gbs": median("host_read_gbs"),
        "linears_ms": median("linears_s") * 1e3, "linears_gbs": nbytes / median("linears_s") / 1e9,
        "fraction_of_host": statistics.median(shares("linears_s")),
        "host_read_gbs_range": [min(r["host_read_gbs"] for r in per_round), max(r["host_read_gbs"] for r in per_round)],
    }
    if fused is not None:
        result["fused_linears_ms"] = median("fused_linears_s") * 1e3
        result["fused_linears_gbs"] = nbytes / median("fused_linears_s") / 1e9
        fused_shares = shares("fused_linears_s")
        result["fused_fraction_of_host"] = statistics.median(fused_shares)
        result["fused_fraction_range"] = [min(fused_shares), max(fused_shares)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--quant", default="none", help="--torchao-config of the run (the LM head is quantized too)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bf16-linear", default="auto", help="--cpu-bf16-linear of the run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds of probe and linears")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(EngineConfig(model_path=args.model, dtype=args.dtype, torchao_config=args.quant,
                                      quantize_lm_head=args.quant != "none", max_total_tokens=256,
                                      cpu_bf16_linear=args.bf16_linear))
    result = linear_bandwidth(runner, rounds=args.rounds)
    result["bf16_linear"] = runner.kernels.bf16_linear
    if args.json:
        print(json.dumps(result))
        return
    low, high = result["host_read_gbs_range"]
    print(f"{result['linears']} linears, {result['weight_bytes'] / 1e6:.1f} MB read per bs1 step in "
          f"{result['linears_ms']:.2f} ms: {result['linears_gbs']:.1f} GB/s = {result['fraction_of_host']:.0%} of the "
          f"host's {result['host_read_gbs']:.1f} GB/s read bandwidth ({low:.1f}-{high:.1f} over the rounds; bf16 "
          f"kernel {result['bf16_linear']}), each called from Python "
          f"(medians of {result['rounds']} interleaved rounds)")
    if "fused_linears_gbs" in result:
        low, high = result["fused_fraction_range"]
        print(f"as the fused step calls them: {result['fused_linears_ms']:.2f} ms, "
              f"{result['fused_linears_gbs']:.1f} GB/s = {result['fused_fraction_of_host']:.0%} "
              f"(rounds {low:.0%}-{high:.0%})")


if __name__ == "__main__":
    main()
