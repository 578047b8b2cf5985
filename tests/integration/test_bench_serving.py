"""`llmserve bench-serving` against real servers on loopback: a tiny-model `llmserve worker` process
(SglangScheduler, token ids) and a one-group cluster (tokenizer, worker, router) through the public
Router API. Every request must succeed with exactly the requested output length, the JSONL must
carry the metrics, and the shared-prefix and multi-turn datasets must hit the worker's radix cache."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from llmserve.cli import main as cli_main
from tests.integration.conftest import WorkerProcess, launch_worker
from tests.integration.test_router import SERVING, _health, one_group_cluster, wait_for

# Room for 4 running requests of ~100 tokens and the cached prefixes beside them.
ENGINE = dict(max_total_tokens=1024, max_running_requests=4, context_length=256)
METRIC_FIELDS = {
    "completed", "failed", "failures", "duration", "total_input_tokens", "total_output_tokens",
    "total_cached_tokens", "cache_hit_rate", "mean_request_cache_hit_ratio", "request_throughput",
    "input_throughput", "output_throughput", "total_throughput", "concurrency", "client_cpu_utilization",
    *(f"{stat}_{name}_ms" for stat in ("mean", "median", "p90", "p99", "std", "max")
      for name in ("ttft", "tpot", "itl", "e2e_latency")),
}
CONFIG_FIELDS = {"date", "backend", "address", "model", "dataset", "prompt_format", "request_rate",
                 "max_concurrency", "seed", "num_requests", "ignore_eos", "temperature"}


@pytest.fixture(scope="module")
def worker(model_factory, tmp_path_factory) -> Iterator[WorkerProcess]:
    workdir = tmp_path_factory.mktemp("bench-worker")
    w = launch_worker(model_factory("tiny"), workdir, "--trace-steps", str(workdir / "steps.jsonl"), **ENGINE)
    yield w
    w.terminate()


def bench(address: str, out: Path, *args: str, capsys=None) -> tuple[int, list[dict]]:
    """Run the command in-process; (exit code, the JSONL lines it appended)."""
    before = len(out.read_text().splitlines()) if out.exists() else 0
    rc = cli_main(["bench-serving", "--address", address, "--output-file", str(out), "--output-details",
                   "--request-timeout", "60", *args])
    lines = out.read_text().splitlines()[before:] if out.exists() else []
    return rc, [json.loads(line) for line in lines]


def check_run(line: dict, n: int, output_len: int) -> None:
    missing = (CONFIG_FIELDS | METRIC_FIELDS) - set(line)
    assert not missing, missing
    assert line["completed"] == n and line["failed"] == 0 and line["failures"] == {}
    assert line["total_output_tokens"] == n * output_len and line["output_len_mismatches"] == 0
    assert len(line["requests"]) == n
    # Each request's label, which the worker's logs name (benchmarks/router_overhead.sh pairs them).
    labels = {r["request_id"] for r in line["requests"]}
    assert len(labels) == n and all(label.startswith("bench-") for label in labels)
    for r in line["requests"]:
        assert r["status"] == "OK" and r["finish_reason"] == "length"
        assert r["output_tokens"] == r["expected_output_len"] == output_len
        assert 0 < r["ttft_ms"] <= r["e2e_ms"] and len(r["itl_ms"]) == output_len - 1
    assert 0 < line["median_ttft_ms"] <= line["p99_ttft_ms"] and line["mean_tpot_ms"] > 0
    assert line["output_throughput"] == pytest.approx(n * output_len / line["duration"])


SHARED_PREFIX = ["--dataset", "shared-prefix", "--num-prompts", "12", "--num-prefixes", "2", "--prefix-len", "64",
                 "--suffix-len", "8", "--output-len", "8"]


def test_worker_random_and_shared_prefix(worker: WorkerProcess, tmp_path: Path, capsys) -> None:
    out = tmp_path / "worker.jsonl"
    rc, (line,) = bench(worker.address, out, "--backend", "worker", "--dataset", "random", "--num-prompts", "16",
                        "--random-input-len", "32", "--random-output-len", "8", "--random-range-ratio", "1",
                        "--max-concurrency", "4")
    assert rc == 0
    check_run(line, 16, 8)
    assert line["backend"] == "worker" and line["max_concurrency"] == 4 and line["request_rate"] == "inf"
    assert line["total_input_tokens"] == 16 * 32
    printed = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in printed
    assert "Successful requests:                     16" in printed

    # Shared prefixes hit the radix cache: a request after its group's first finished reuses the prefix.
    rc, (line,) = bench(worker.address, out, "--backend", "worker", *SHARED_PREFIX, "--max-concurrency", "2",
                        "--flush-cache")
    assert rc == 0
    check_run(line, 12, 8)
    assert line["total_input_tokens"] == 12 * 72
    hits = [r["cached_tokens"] for r in line["requests"]]
    assert line["total_cached_tokens"] == sum(hits) > 0 and max(hits) >= 64 and line["cache_hit_rate"] > 0.5

    # The worker's --trace-steps file: a line per step, the 28 requests' first tokens among them (and any idle
    # health probe's), the shared-prefix run's cached tokens as prefix tokens.
    def traced() -> list[dict]:
        text = (worker.log_path.parent / "steps.jsonl").read_text()
        return [json.loads(t) for t in text[: text.rfind("\n") + 1].splitlines()]  # whole lines only

    wait_for(lambda: sum(step["first_tokens"] for step in traced()) >= 16 + 12, timeout=10)
    steps = traced()
    assert {step["mode"] for step in steps} == {"extend", "decode"}
    assert sum(step["prefix_tokens"] for step in steps) >= line["total_cached_tokens"]


MULTI_TURN = ["--dataset", "multi-turn", "--num-conversations", "3", "--turns", "3", "--turn-len", "16",
              "--output-len", "8", "--max-concurrency", "2", "--seed", "5"]


def check_multi_turn(line: dict) -> None:
    check_run(line, 9, 8)
    turns: dict[int, list[dict]] = {}
    for r in line["requests"]:
        turns.setdefault(r["conversation"], []).append(r)
    assert sorted(turns) == [0, 1, 2]
    for chat in turns.values():
        chat.sort(key=lambda r: r["turn"])
        assert [r["prompt_tokens"] for r in chat] == [16, 40, 64]  # + the previous answer + a new message
        for prev, cur in zip(chat, chat[1:], strict=False):
            # The previous prompt and all but the last answer token (whose KV was never computed).
            assert cur["cached_tokens"] == prev["prompt_tokens"] + 8 - 1


def test_worker_multi_turn_extends_each_turn_and_hits_the_cache(worker: WorkerProcess, tmp_path: Path) -> None:
    rc, (line,) = bench(worker.address, tmp_path / "mt.jsonl", "--backend", "worker", *MULTI_TURN, "--flush-cache")
    assert rc == 0
    check_multi_turn(line)


def test_start_at_holds_the_first_request_until_that_wall_clock_time(worker: WorkerProcess, tmp_path: Path,
                                                                    capsys) -> None:
    """--start-at: the run starts at the given Unix time, not when the client is ready; a time already past
    starts at once and says so."""
    start_at = time.time() + 3.0
    rc, (line,) = bench(worker.address, tmp_path / "at.jsonl", "--backend", "worker", "--num-prompts", "2",
                        "--random-input-len", "8", "--random-output-len", "2", "--start-at", str(start_at))
    assert rc == 0 and line["completed"] == 2
    # The run's clock starts at its first request; the record's date is its end.
    started = datetime.fromisoformat(line["date"]).timestamp() - line["duration"]
    assert started >= start_at - 0.05
    rc, (late,) = bench(worker.address, tmp_path / "at.jsonl", "--backend", "worker", "--num-prompts", "2",
                        "--random-input-len", "8", "--random-output-len", "2", "--start-at", str(time.time() - 5))
    assert rc == 0 and late["completed"] == 2
    assert re.search(r"--start-at: \d+\.\d{3} s late, starting now", capsys.readouterr().out)


def test_worker_failures_are_counted_by_status(worker: WorkerProcess, tmp_path: Path, capsys) -> None:
    """Prompts longer than the context: every request is RESOURCE_EXHAUSTED, reported and exit 1."""
    rc, (line,) = bench(worker.address, tmp_path / "bad.jsonl", "--backend", "worker", "--num-prompts", "4",
                        "--random-input-len", "300", "--random-output-len", "4", "--random-range-ratio", "1")
    assert rc == 1
    assert line["completed"] == 0 and line["failures"] == {"RESOURCE_EXHAUSTED": 4}
    assert all(r["status"] == "RESOURCE_EXHAUSTED" and r["error"] for r in line["requests"])
    captured = capsys.readouterr()
    assert "RESOURCE_EXHAUSTED:" in captured.out and "some requests failed" in captured.err


def test_router_ids_and_text_prompts(model_factory, tmp_path: Path) -> None:
    model = model_factory("tiny")
    engine = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    with one_group_cluster(model, tmp_path, ["--dtype", "float32", *engine]) as (_, _, router):
        out = tmp_path / "router.jsonl"
        rc, lines = bench(router.address, out, "--backend", "router", "--num-prompts", "12",
                          "--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "1",
                          "--request-rate", "inf", "40", "--max-concurrency", "8")
        assert rc == 0 and len(lines) == 2  # one line per run: rate inf, then 40 req/s
        for line, rate in zip(lines, ("inf", 40.0), strict=True):
            check_run(line, 12, 6)
            assert line["request_rate"] == rate and line["total_input_tokens"] == 12 * 24
        assert lines[0]["seed"] != lines[1]["seed"]

        # Text through the router's tokenizer; shared prefixes still hit the worker's cache.
        rc, (line,) = bench(router.address, out, "--backend", "router", "--prompt-format", "text",
                            "--model", str(model), *SHARED_PREFIX, "--max-concurrency", "2")
        assert rc == 0
        check_run(line, 12, 8)
        assert line["prompt_format"] == "text" and line["total_cached_tokens"] > 0

        # Multi-turn: each answer (its ids, collected from the router's deltas) goes into the next turn.
        rc, (line,) = bench(router.address, out, "--backend", "router", *MULTI_TURN)
        assert rc == 0
        check_multi_turn(line)


def test_wait_for_server_waits_for_serving_not_only_for_an_answer(model_factory, tmp_path: Path, capsys) -> None:
    """A router answers GetModelInfo (remembered from its worker) while no worker group serves. Regression:
    --wait-for-server returned then, and the warm-up failed UNAVAILABLE. Now it waits for grpc.health's
    SERVING: it says so when the wait runs out, and runs once the worker is back."""
    model = model_factory("tiny")
    engine = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    with one_group_cluster(model, tmp_path, ["--dtype", "float32", *engine]) as (_, worker, router):
        worker.proc.send_signal(signal.SIGSTOP)  # its health probes time out: the router stops serving
        wait_for(lambda: _health(router.address) != SERVING, 30, what="router NOT_SERVING")
        out = tmp_path / "out.jsonl"
        args = ("--backend", "router", "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2",
                "--random-range-ratio", "1")
        start = time.monotonic()
        rc, lines = bench(router.address, out, *args, "--wait-for-server", "3")
        assert rc != 0 and not lines and time.monotonic() - start >= 3
        assert "did not become SERVING within --wait-for-server 3 s" in capsys.readouterr().err
        worker.proc.send_signal(signal.SIGCONT)
        rc, (line,) = bench(router.address, out, *args, "--wait-for-server", "60")
        assert rc == 0
        check_run(line, 2, 2)
