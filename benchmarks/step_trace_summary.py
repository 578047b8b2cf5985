"""Summarize a worker's step trace (``llmserve worker --trace-steps FILE``; docs/metrics.md): steps by kind and
size, and where the time to first token of requests computed in one step went (the wait from arrival, the step).

    python benchmarks/step_trace_summary.py FILE [--since UNIX_TIME] [--last-steps N]

``--since`` / ``--last-steps`` keep only the steps from that time / the last N steps (a trace covers the worker's
whole life: e.g. ``benchmarks/serving_peers.sh`` TRACE_STEPS=1 runs two workloads on its first worker).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(steps: list[dict]) -> list[str]:
    out = []
    for mode in ("extend", "decode"):
        ms = [s["ms"] for s in steps if s["mode"] == mode]
        if ms:
            out.append(f"{mode} steps: {len(ms)}, {sum(ms):.0f} ms in all, median {statistics.median(ms):.1f} ms")
    extend_sizes: dict[tuple[int, int], list[float]] = defaultdict(list)
    for s in steps:
        if s["mode"] == "extend":
            extend_sizes[(s["extends"], s["extend_tokens"])].append(s["ms"])
    out.append("extend steps by (requests, prompt tokens): count, median ms")
    for (n, tokens), ms in sorted(extend_sizes.items(), key=lambda kv: -len(kv[1]))[:12]:
        out.append(f"  {n:3d} requests, {tokens:5d} tokens: {len(ms):4d} steps, {statistics.median(ms):7.1f} ms")
    decode_sizes: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        if s["mode"] == "decode":
            decode_sizes[s["decodes"]].append(s["ms"])
    if decode_sizes:
        out.append("decode steps by batch: " + ", ".join(
            f"{n}: {statistics.median(ms):.1f} ms ({len(ms)})" for n, ms in sorted(decode_sizes.items())))
    # Requests admitted and given their first token in the same step (every extend of the step finished its
    # prompt): their TTFT inside the worker is the wait from arrival plus that step.
    waits, own = [], []
    for s in steps:
        queued = s.get("queued_ms", [])
        if queued and s["extends"] == len(queued) == s["first_tokens"]:
            waits += queued
            own += [s["ms"]] * len(queued)
    if waits:
        ttft = [w + m for w, m in zip(waits, own, strict=True)]
        out.append(f"one-step prompts: {len(waits)}; wait from arrival p50 {pct(waits, 0.5):.1f} ms (p90 "
                   f"{pct(waits, 0.9):.1f}), their step p50 {pct(own, 0.5):.1f} ms, wait + step p50 "
                   f"{pct(ttft, 0.5):.1f} ms (p90 {pct(ttft, 0.9):.1f})")
    all_waits = [q for s in steps for q in s.get("queued_ms", [])]
    if all_waits:
        out.append(f"all admissions: {len(all_waits)}, wait from arrival p50 {pct(all_waits, 0.5):.1f} ms")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--since", type=float, default=None, help="only steps starting at or after this unix time")
    parser.add_argument("--last-steps", type=int, default=None, help="only the last N steps")
    args = parser.parse_args()
    steps = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    if args.since is not None:
        steps = [s for s in steps if s["t"] >= args.since]
    if args.last_steps is not None:
        steps = steps[-args.last_steps:]
    if not steps:
        raise SystemExit("no steps in the trace (after the filters)")
    print("\n".join(summarize(steps)))


if __name__ == "__main__":
    main()
