"""Tensor parallelism against one rank on the same cores, interleaved: TP=2 (1 thread per rank, shared
memory and gloo, two-batch overlap off and on) against TP=1 with 2 threads and with 1 thread, decode
and prefill, in rounds (every configuration once per round, so drift on a shared machine hits them alike).

    .venv/bin/python benchmarks/tp_scaling.py MODEL [--rounds 3] [--batch-size 1 16] [--input-len 128]
        [--configs NAME ...] [--profile]

Each run is `llmserve bench-one-batch` in its own process; prints one markdown row per
configuration and batch size with the per-round medians, and with --profile the leader's
collective time per decode step and the part of it the step was blocked on (overlap hides the rest).
docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {
    "TP=1, 2 threads": ["--tp", "1", "--threads", "2"],
    "TP=1, 1 thread": ["--tp", "1", "--threads", "1"],
    "TP=2 shm, 1 thread/rank": ["--tp", "2", "--threads", "1", "--tp-comm", "shm"],
    "TP=2 gloo, 1 thread/rank": ["--tp", "2", "--threads", "1", "--tp-comm", "gloo"],
    "TP=2 shm + overlap": ["--tp", "2", "--threads", "1", "--tp-comm", "shm", "--enable-two-batch-overlap",
                           "--tbo-min-tokens", "2"],
    "TP=2 gloo + overlap": ["--tp", "2", "--threads", "1", "--tp-comm", "gloo", "--enable-two-batch-overlap",
                            "--tbo-min-tokens", "2"],
}
DEFAULT_CONFIGS = ["TP=1, 2 threads", "TP=1, 1 thread", "TP=2 shm, 1 thread/rank", "TP=2 gloo, 1 thread/rank"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    p.add_argument("--profile", action="store_true", help="--profile-collectives on the TP runs")
    args = p.parse_args()
    runs: dict[str, list[list[dict]]] = {name: [] for name in args.configs}
    work = Path(tempfile.mkdtemp())
    for round_ in range(args.rounds):
        for name in args.configs:
            out = work / f"r{round_}.json"
            cmd = [sys.executable, "-m", "llmserve.cli", "bench-one-batch", "--model", args.model,
                   "--dtype", args.dtype, "--batch-size", *map(str, args.batch_size),
                   "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--max-total-tokens", str(max(args.batch_size) * (args.input_len + args.output_len) + 64),
                   "--max-running-requests", str(max(64, max(args.batch_size))),
                   "--result-file", str(out), *CONFIGS[name],
                   *(["--profile-collectives"] if args.profile and "TP=2" in name else [])]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs[name].append(json.loads(out.read_text()))
            print(f"round {round_ + 1}: {name} done", file=sys.stderr, flush=True)
    extra = " decode collectives ms | blocked ms | prefill collectives ms | blocked ms |" if args.profile else ""
    print("| configuration | batch | decode step ms (rounds) | median | prefill tok/s (rounds) | median |" + extra)
    print("|---|---:|---|---:|---|---:|" + ("---:|" * 4 if args.profile else ""))
    for name, rounds in runs.items():
        for i, bs in enumerate(args.batch_size):
            steps = [r[i]["median_decode_latency"] * 1e3 for r in rounds]
            prefill = [r[i]["prefill_throughput"] for r in rounds]
            row = (f"| {name} | {bs} | {' / '.join(f'{s:.1f}' for s in steps)} | {statistics.median(steps):.1f} | "
                   f"{' / '.join(f'{t:.0f}' for t in prefill)} | {statistics.median(prefill):.0f} |")
            if args.profile:
                for phase in ("decode", "prefill"):
                    totals = [r[i]["collectives"].get(phase, {}).get("total") for r in rounds]
                    if all(totals):
                        row += (f" {statistics.median(t['ms'] for t in totals):.2f} |"
                                f" {statistics.median(t['blocked_ms'] for t in totals):.2f} |")
                    else:
                        row += " - | - |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
