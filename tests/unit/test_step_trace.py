"""The worker's step trace (--trace-steps): one JSON line per step, on a real engine and engine loop."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from worker_svc.config.engine_config import EngineConfig
from worker_svc.engine.engine import Engine
from worker_svc.engine.engine_loop import EngineLoop
from worker_svc.engine.step_trace import StepTraceFile
from worker_svc.sampling import SamplingParams


def _run(tiny_model, trace: StepTraceFile, batches: list[list[tuple[str, list[int], int]]]) -> None:
    """Each batch's requests (rid, prompt, max_new_tokens) submitted together, the next batch once they finish."""
    engine = Engine(EngineConfig(model_path=str(tiny_model), dtype="float32", max_total_tokens=512,
                                 max_running_requests=4, chunked_prefill_size=16, max_prefill_tokens=64,
                                 context_length=256))
    loop = EngineLoop(engine, step_trace=trace)
    loop.start()
    try:
        for batch in batches:
            done = threading.Event()
            left = [len(batch)]
            lock = threading.Lock()

            def sink(item) -> None:
                if getattr(item, "finished", True):
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()

            for rid, prompt, new in batch:
                loop.submit(prompt, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True), rid, sink)
            assert done.wait(30)
    finally:
        loop.stop()
        trace.close()


def test_the_trace_has_a_line_per_step_with_its_tokens_and_queues(tiny_model, tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    prompt = [(7 * j + 3) % 200 for j in range(40)]
    # A 40-token prompt in chunks of 16, then the same prompt again (all but its last token cached) next to a
    # fresh 5-token one.
    _run(tiny_model, StepTraceFile(path), [[("a", prompt, 3)], [("b", prompt, 2), ("c", [9, 8, 7, 6, 5], 2)]])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    keys = {"step", "t", "ms", "mode", "extends", "extend_tokens", "prefix_tokens", "decodes", "queued_ms",
            "first_tokens", "finished", "running", "waiting"}
    assert all(set(line) == keys for line in lines)
    assert [line["step"] for line in lines] == sorted(line["step"] for line in lines)
    assert all(line["ms"] > 0 for line in lines)
    assert all(b["t"] >= a["t"] for a, b in zip(lines, lines[1:], strict=False))

    extends = [line for line in lines if line["mode"] == "extend"]
    # a: 16 + 16 + 8 tokens after 0, 16, 32 of its own; b: 1 token after 39 cached; c: 5 after none.
    assert [(e["extend_tokens"], e["prefix_tokens"]) for e in extends[:3]] == [(16, 0), (16, 16), (8, 32)]
    assert [e["first_tokens"] for e in extends[:3]] == [0, 0, 1]
    assert sum(e["extend_tokens"] for e in extends[3:]) == 6
    assert sum(e["prefix_tokens"] for e in extends[3:]) == 39
    assert sum(e["first_tokens"] for e in extends) == 3
    # Each request's wait from arrival, once, in the step that first admitted it: a's first chunk, b and c's step.
    assert [len(e["queued_ms"]) for e in extends[:3]] == [1, 0, 0] and sum(len(e["queued_ms"]) for e in lines) == 3
    assert all(0 <= q < 30_000 for e in extends for q in e["queued_ms"])
    # Every token after the first comes from a decode step or a rider of a mixed one: 2 for a, 1 each for b, c.
    assert sum(line["decodes"] for line in lines) == 4
    assert sum(line["finished"] for line in lines) == 3
    assert lines[-1]["running"] == 0 and lines[-1]["waiting"] == 0
    assert all(line["running"] + line["waiting"] <= 2 for line in lines)

    # benchmarks/step_trace_summary.py reads it: b and c were admitted and answered in one step, a in chunks.
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "step_trace_summary.py"
    printed = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    assert f"extend steps: {len(extends)}," in printed
    assert "one-step prompts: 2;" in printed and "all admissions: 3," in printed


def test_an_unwritable_trace_path_is_refused_naming_the_flag(tmp_path) -> None:
    with pytest.raises(ValueError, match="--trace-steps: cannot write"):
        StepTraceFile(tmp_path / "missing" / "steps.jsonl")
