"""Ours against the engines a user would pick instead, on the same model, in one sitting (issue 15).

Per round, one after the other on the same cores: ours (bench-one-batch, bf16 and 4-bit), vLLM's CPU
build (bf16; one process loaded once, measured each round through benchmarks/peer_vllm.py) and llama.cpp
(its Q4_1 GGUF file: llama-bench for bs1, llama-batched-bench for bs16). The table has each engine's
per-round figures and their median, then the ratios of the medians. It also measures the host's read
bandwidth and how much of it our bs1 linears reach (benchmarks/linear_bandwidth.py).

Nothing is installed: a peer whose python / binaries are not given or not found is skipped, saying so
(`../shared/peers.md` has the recipes: the vLLM venv, the llama.cpp build).

    python benchmarks/peers.py MODEL [--gguf FILE] [--vllm-python PY] [--llama-cpp-bin DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
INPUT_LEN = 128


@dataclass
class Series:
    """One engine's figures for one measurement, a value per round."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    def text(self, fmt: str) -> str:
        if not self.values:
            return "-"
        rounds = " / ".join(format(v, fmt) for v in self.values)
        return f"{rounds} (median {format(self.median, fmt)})" if len(self.values) > 1 else rounds


def run_ours(model: str, threads: int, output_len: int, quant: str | None,
             compiled: bool = False) -> dict[int, dict[str, float]]:
    """bench-one-batch at bs1 and bs16 (``compiled``: with --enable-torch-compile): {batch: {"step_ms", "tok_s",
    "prefill_tok_s"}}."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "llmserve.cli", "bench-one-batch", "--model", model, "--dtype", "bfloat16",
               "--batch-size", "1", "16", "--input-len", str(INPUT_LEN), "--output-len", str(output_len),
               "--threads", str(threads), "--max-total-tokens", str(16 * (INPUT_LEN + output_len) + 64),
               "--result-file", str(result)]
        if quant:
            cmd += ["--torchao-config", quant, "--quantize-lm-head"]
        if compiled:
            cmd.append("--enable-torch-compile")
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
        rows = json.loads(result.read_text())
    return {r["batch_size"]: {"step_ms": r["median_decode_latency"] * 1e3,
                              "tok_s": r["batch_size"] / r["median_decode_latency"],
                              "prefill_tok_s": r["prefill_throughput"]} for r in rows}


class VllmProcess:
    """One vLLM engine for the whole sitting (it takes minutes to start), measured on request."""

    def __init__(self, python: str, model: str, threads: int) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
        self.proc = subprocess.Popen([python, str(ROOT / "benchmarks" / "peer_vllm.py"), model], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._read()  # {"ready": true}

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"vLLM exited with {self.proc.wait()}")

    def measure(self, batch: int, output_len: int) -> dict[str, float]:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(f"{batch} {output_len} {INPUT_LEN}\n")
        stdin.flush()
        got = self._read()
        return {"step_ms": got["decode_step_s"] * 1e3, "tok_s": batch / got["decode_step_s"],
                "prefill_tok_s": got["prefill_tok_s"]}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_llama_cpp(bin_dir: Path, gguf: str, threads: int, output_len: int) -> dict[int, dict[str, float]]:
    bench = subprocess.run([str(bin_dir / "llama-bench"), "-m", gguf, "-t", str(threads), "-p", str(INPUT_LEN),
                            "-n", str(output_len), "-r", "3", "-o", "json"],
                           check=True, capture_output=True, text=True, timeout=900)
    rows = json.loads(bench.stdout)
    prefill = next(r["avg_ts"] for r in rows if r["n_prompt"] == INPUT_LEN and r["n_gen"] == 0)
    gen = next(r["avg_ts"] for r in rows if r["n_gen"] == output_len and r["n_prompt"] == 0)
    batched = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", gguf, "-t", str(threads), "-c", "8192",
                              "-npp", str(INPUT_LEN), "-ntg", str(output_len), "-npl", "16"],
                             check=True, capture_output=True, text=True, timeout=900)
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    row = next(line for line in batched.stdout.splitlines() if re.match(r"\|\s*\d+\s*\|\s*\d+\s*\|\s*16\s*\|", line))
    cells = [c.strip() for c in row.strip("|").split("|")]
    gen16 = float(cells[7])
    return {1: {"step_ms": 1e3 / gen, "tok_s": gen, "prefill_tok_s": prefill},
            16: {"step_ms": 16e3 / gen16, "tok_s": gen16, "prefill_tok_s": float(cells[5])}}


# Acceptance 2 of issue 15: the bs1 linears' share of the host's read bandwidth, bf16 and the weight-only configs.
BANDWIDTH_QUANTS = ("none", "int8wo", "int4wo-32")
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def host_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name and the ISA extensions the kernels choose by, from /proc/cpuinfo."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return f"{model}, {os.cpu_count()} CPUs, ISA: {' '.join(f for f in ISA_FLAGS if f in flags) or 'baseline'}"


def _failure(exc: subprocess.CalledProcessError | subprocess.TimeoutExpired) -> str:
    name = Path(str(exc.cmd[0])).name
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"{name} timed out after {exc.timeout:.0f} s"
    if exc.returncode < 0:
        return f"{name} died with {signal.Signals(-exc.returncode).name}"
    return f"{name} exited with status {exc.returncode}"


def run_bandwidth(model: str, threads: int, quant: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "linear_bandwidth.py"), model, "--quant", quant,
                          "--threads", str(threads), "--json"], cwd=ROOT, check=True, capture_output=True, text=True,
                         timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="HF folder (ours and vLLM)")
    parser.add_argument("--gguf", help="the GGUF file for llama.cpp (default: a *.gguf inside MODEL)")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed")
    parser.add_argument("--llama-cpp-bin", type=Path, help="folder with llama-bench and llama-batched-bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quant", default="int4wo-32", help="our 4-bit configuration (Q4_1 is group-32 4-bit)")
    parser.add_argument("--compiled", action="store_true",
                        help="also run ours with --enable-torch-compile (each run compiles at start: ~40 s cached)")
    args = parser.parse_args()
    model = str(Path(args.model).resolve())
    gguf = args.gguf or next((str(p) for p in sorted(Path(model).glob("*.gguf"))), None)

    skipped = []
    vllm = None
    if not args.vllm_python or not shutil.which(args.vllm_python):
        skipped.append("vLLM-CPU: no --vllm-python given or found")
    else:
        print("starting vLLM (minutes) ...", file=sys.stderr)
        vllm = VllmProcess(args.vllm_python, model, args.threads)
    llama_bin = args.llama_cpp_bin
    if llama_bin is None or not (llama_bin / "llama-bench").exists():
        skipped.append("llama.cpp: no --llama-cpp-bin with llama-bench given")
        llama_bin = None
    elif gguf is None:
        skipped.append("llama.cpp: no GGUF file (--gguf) for this model")
        llama_bin = None

    # (engine, measure, batch) -> Series
    table: dict[tuple[str, str, int], Series] = {}

    def record(engine: str, got: dict[int, dict[str, float]]) -> None:
        for batch, figures in got.items():
            for measure, value in figures.items():
                table.setdefault((engine, measure, batch), Series()).values.append(value)

    bandwidth: dict[str, list[dict[str, float]]] = {}
    try:
        for round_no in range(1, args.rounds + 1):
            print(f"round {round_no}/{args.rounds}", file=sys.stderr)
            for compiled in (False, True) if args.compiled else (False,):
                suffix = " compiled" if compiled else ""
                record(f"ours bf16{suffix}", run_ours(model, args.threads, args.output_len, None, compiled))
                record(f"ours {args.quant}{suffix}",
                       run_ours(model, args.threads, args.output_len, args.quant, compiled))
            if vllm is not None:
                record("vLLM-CPU bf16", {b: vllm.measure(b, args.output_len) for b in (1, 16)})
            if llama_bin is not None and gguf is not None:
                try:
                    record("llama.cpp Q4_1", run_llama_cpp(llama_bin, gguf, args.threads, args.output_len))
                except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                    # A peer that crashes on this host (llama.cpp's AMX path has) is reported, not fatal.
                    skipped.append(f"llama.cpp from round {round_no}: {_failure(exc)}")
                    llama_bin = None
            for quant in BANDWIDTH_QUANTS:
                bandwidth.setdefault(quant, []).append(run_bandwidth(model, args.threads, quant))
    finally:
        if vllm is not None:
            vllm.close()

    engines = list(dict.fromkeys(engine for engine, _, _ in table))
    print(f"\nmodel {model}, {args.threads} threads, input {INPUT_LEN}, output {args.output_len}, {args.rounds} rounds")
    print(f"host: {host_description()}")
    print("\n| engine | decode step bs1 ms | decode tok/s bs1 | decode step bs16 ms | decode tok/s bs16 (aggregate) "
          "| prefill 128 tok/s bs1 |")
    print("|---|---|---|---|---|---|")
    for engine in engines:
        def cell(measure: str, batch: int, fmt: str, engine: str = engine) -> str:
            return table.get((engine, measure, batch), Series()).text(fmt)
        print(f"| {engine} | {cell('step_ms', 1, '.1f')} | {cell('tok_s', 1, '.0f')} | {cell('step_ms', 16, '.1f')} | "
              f"{cell('tok_s', 16, '.0f')} | {cell('prefill_tok_s', 1, '.0f')} |")

    def ratio(a: str, b: str, measure: str, batch: int) -> str:
        x, y = table.get((a, measure, batch)), table.get((b, measure, batch))
        if x is None or y is None or not x.median or not y.median:
            return "-"
        return f"{x.median / y.median:.2f}x"

    print("\nratios of the medians (higher is better for ours):")
    pairs = [(f"ours bf16{suffix}", "vLLM-CPU bf16") for suffix in ("", " compiled")]
    pairs += [(f"ours {args.quant}{suffix}", "llama.cpp Q4_1") for suffix in ("", " compiled")]
    pairs = [(ours, peer) for ours, peer in pairs if any(engine == ours for engine, _, _ in table)]
    for ours, peer in pairs:
        print(f"- {ours} / {peer}: decode bs1 {ratio(ours, peer, 'tok_s', 1)}, decode bs16 "
              f"{ratio(ours, peer, 'tok_s', 16)}, prefill bs1 {ratio(ours, peer, 'prefill_tok_s', 1)}")
    for quant, runs in bandwidth.items():
        fractions = [b["fraction_of_host"] for b in runs]
        linears = " / ".join(format(b["linears_gbs"], ".1f") for b in runs)
        host = " / ".join(format(b["host_read_gbs"], ".1f") for b in runs)
        shares = " / ".join(format(f, ".0%") for f in fractions)
        name = "bf16" if quant == "none" else quant
        print(f"bs1 {name} linears: {linears} GB/s of their own bytes against the host's {host} GB/s read "
              f"bandwidth ({shares}; median {statistics.median(fractions):.0%}), each called from Python")
        fused = [b["fused_fraction_of_host"] for b in runs if "fused_fraction_of_host" in b]
        if fused:
            print(f"bs1 {name} linears as the fused step calls them: "
                  + " / ".join(format(b["fused_linears_gbs"], ".1f") for b in runs if "fused_linears_gbs" in b)
                  + f" GB/s ({' / '.join(format(f, '.0%') for f in fused)}; median {statistics.median(fused):.0%})")
    for line in skipped:
        print(f"skipped {line}")


if __name__ == "__main__":
    main()
