"""`llmserve bench-serving`'s datasets, arrival schedule and statistics (llmserve/bench/datasets.py,
llmserve/bench/serving.py): exact values on small seeded cases."""

from __future__ import annotations

import json
import math
import random
import statistics

import numpy as np
import pytest

from llmserve.bench import datasets as ds
from llmserve.bench import serving, serving_report, serving_stats
from llmserve.bench.serving_stats import RequestRecord, RunResult
from llmserve.cli import main as cli_main
from tokenizer_svc.tokenizer import ModelTokenizer

SPACE = ds.TokenSpace(512, frozenset({0, 1, 2}))


# ---- datasets ------------------------------------------------------------------------------------


def test_sample_len_follows_sglangs_range() -> None:
    rng = random.Random(0)
    assert {ds.sample_len(rng, 10, 1.0) for _ in range(50)} == {10}
    assert {ds.sample_len(rng, 10, 0.5) for _ in range(500)} == set(range(5, 11))
    assert {ds.sample_len(rng, 4, 0.0) for _ in range(500)} == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="range ratio"):
        ds.sample_len(rng, 10, 1.5)


def test_random_requests_are_seeded_exact_and_avoid_excluded_ids() -> None:
    a = ds.random_requests(20, 32, 8, 1.0, SPACE, seed=7)
    assert a == ds.random_requests(20, 32, 8, 1.0, SPACE, seed=7)
    assert a != ds.random_requests(20, 32, 8, 1.0, SPACE, seed=8)
    assert all(len(r.prompt.ids) == 32 and r.output_len == 8 and r.group == -1 for r in a)
    ids = {i for r in a for i in r.prompt.ids}
    assert not ids & SPACE.excluded and min(ids) >= 3 and max(ids) < 512
    varied = ds.random_requests(200, 32, 8, 0.25, SPACE, seed=7)
    assert {len(r.prompt.ids) for r in varied} == set(range(8, 33))
    assert {r.output_len for r in varied} == set(range(2, 9))


def test_shared_prefix_prompts_share_their_groups_prefix_and_arrive_shuffled() -> None:
    reqs = ds.shared_prefix_requests(10, 3, prefix_len=16, suffix_len=4, output_len=5, space=SPACE, seed=3)
    assert reqs == ds.shared_prefix_requests(10, 3, 16, 4, 5, SPACE, seed=3)
    assert sorted(r.group for r in reqs) == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # interleaved, not grouped
    prefixes = {}
    for r in reqs:
        assert len(r.prompt.ids) == 20 and r.prefix_len == 16 and r.output_len == 5
        prefixes.setdefault(r.group, set()).add(r.prompt.ids[:16])
    assert all(len(p) == 1 for p in prefixes.values())  # one prefix per group ...
    assert len({next(iter(p)) for p in prefixes.values()}) == 3  # ... and three different ones
    assert len({r.prompt.ids[16:] for r in reqs}) == 10  # every suffix its own


def test_multi_turn_prompt_extends_the_previous_turn_and_its_answer() -> None:
    (conv,) = ds.conversations(1, 3, turn_len=5, output_len=4, space=SPACE, seed=1)
    assert len(conv.user_turns) == 3 and all(len(u.ids) == 5 for u in conv.user_turns)
    answer = RequestRecord(index=0, expected_output_len=4, input_len=5, output_ids=[9, 8, 7, 6])
    first = serving._next_turn(None, None, conv.user_turns[0], None)
    assert first.ids == conv.user_turns[0].ids
    second = serving._next_turn(first, answer, conv.user_turns[1], None)
    assert second.ids == first.ids + (9, 8, 7, 6) + conv.user_turns[1].ids


def test_arrivals_are_poisson_at_the_rate_or_all_at_once() -> None:
    assert ds.arrival_offsets(5, float("inf"), seed=0) == [0.0] * 5
    offsets = ds.arrival_offsets(20000, 10.0, seed=0)
    assert offsets == ds.arrival_offsets(20000, 10.0, seed=0)
    gaps = np.diff([0.0, *offsets])
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.02)
    assert gaps.std() == pytest.approx(0.1, rel=0.03)  # exponential: std equals the mean
    with pytest.raises(ValueError, match="request rate"):
        ds.arrival_offsets(3, 0.0, seed=0)


def test_text_prompts_keep_the_shared_prefix_and_their_length(tiny_model) -> None:
    tok = ModelTokenizer.from_dir(tiny_model)
    space = ds.text_space(ds.TokenSpace(tok.vocab_size, frozenset(tok.special_tokens)), tok)
    assert 256 < len(space.allowed()) < tok.vocab_size - len(tok.special_tokens)  # partial UTF-8 bytes are out
    maker = ds.TextMaker(tok, space, random.Random(0))
    reqs = ds.requests_as_text(ds.shared_prefix_requests(6, 2, 40, 8, 4, space, seed=0), maker)
    by_group: dict[int, list[ds.Prompt]] = {}
    for r in reqs:
        assert r.prompt.text and "\ufffd" not in r.prompt.text
        assert list(r.prompt.ids) == tok.encode(r.prompt.text) and r.prompt.ids[0] == tok.bos_token_id
        by_group.setdefault(r.group, []).append(r.prompt)
    for prompts in by_group.values():
        # The group's ids share all of the prefix but where it meets the suffix: BOS + 40 tokens, give
        # or take (and so does its text, which is the prefix's text once).
        shared = 0
        while len({p.ids[shared] for p in prompts}) == 1:
            shared += 1
        assert 36 <= shared <= 41
        assert len({tok.decode(p.ids[1:shared]) for p in prompts}) == 1
    assert by_group[0][0].ids[1:30] != by_group[1][0].ids[1:30]
    # The text tokenizes back to the length asked for (a cut may lose a token or so).
    for r in ds.random_requests(20, 64, 4, 1.0, space, seed=1):
        assert 62 <= len(maker.prompt(r.prompt).ids) - 1 <= 64


# ---- statistics ----------------------------------------------------------------------------------


def test_percentile_matches_numpys_linear_interpolation() -> None:
    assert serving_stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert serving_stats.percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert serving_stats.percentile([4, 1, 3, 2], 99) == pytest.approx(3.97)
    assert serving_stats.percentile([5.0], 99) == 5.0
    assert math.isnan(serving_stats.percentile([], 50))
    values = [random.Random(2).random() for _ in range(101)]
    for p in (0, 10, 50, 90, 99, 100):
        assert serving_stats.percentile(values, p) == pytest.approx(np.percentile(values, p))
    d = serving_stats.distribution([0.001, 0.002, 0.003, 0.010])
    assert d["mean"] == pytest.approx(4.0) and d["median"] == pytest.approx(2.5) and d["max"] == pytest.approx(10.0)
    assert d["std"] == pytest.approx(statistics.pstdev([1, 2, 3, 10]))


def _record(index: int, stamps: list[float], counts: list[int], done: float, **kw) -> RequestRecord:
    return RequestRecord(index=index, expected_output_len=sum(counts), input_len=10, sent=0.0,
                                 stamps=stamps, counts=counts, done=done, status=serving_stats.OK, **kw)


def test_request_timings_ttft_itl_tpot_e2e() -> None:
    rec = _record(0, [0.100, 0.150, 0.250], [1, 1, 2], done=0.300)
    assert rec.ttft == pytest.approx(0.1) and rec.e2e == pytest.approx(0.3)
    assert rec.output_tokens == 4
    assert rec.itls() == pytest.approx([0.05, 0.05, 0.05])  # the 2-token message: two gaps of 50 ms
    assert rec.tpot == pytest.approx((0.3 - 0.1) / 3)
    assert _record(1, [0.1], [1], done=0.1).tpot is None  # one token: no TPOT


def test_summary_counts_failures_cache_and_throughput() -> None:
    a = _record(0, [0.1, 0.2], [1, 1], done=0.2, prompt_tokens=100, completion_tokens=2, cached_tokens=60)
    b = _record(1, [0.3, 0.5], [1, 1], done=0.5, prompt_tokens=50, completion_tokens=2, cached_tokens=0)
    bad = RequestRecord(index=2, expected_output_len=2, input_len=10, status="RESOURCE_EXHAUSTED")
    skipped = RequestRecord(index=3, expected_output_len=2, input_len=0)
    result = RunResult(float("inf"), 4, 1, [a, b, bad, skipped], duration=2.0, client_cpu_s=0.5)
    m = serving_stats.summarize(result)
    assert m["completed"] == 2 and m["failed"] == 2
    assert m["failures"] == {"RESOURCE_EXHAUSTED": 1, serving_stats.NOT_SENT: 1}
    assert m["total_input_tokens"] == 150 and m["total_output_tokens"] == 4 and m["total_cached_tokens"] == 60
    assert m["cache_hit_rate"] == pytest.approx(0.4) and m["mean_request_cache_hit_ratio"] == pytest.approx(0.3)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.0 and m["input_throughput"] == 75.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_itl_ms"] == pytest.approx(150.0) and m["p99_e2e_latency_ms"] == pytest.approx(497.0)
    assert m["concurrency"] == pytest.approx(0.35) and m["client_cpu_utilization"] == 0.25
    assert m["output_len_mismatches"] == 0

    text = serving_report.report("worker", "random", result, m)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    assert "Successful requests:                     2" in text and "  RESOURCE_EXHAUSTED:" in text
    assert "Traffic request rate:                    inf" in text
    config = serving.BenchConfig(backend="worker", address="127.0.0.1:1", dataset=serving.DatasetConfig())
    line = serving_report.result_line(config.describe("tiny"), result, m, details=True)
    again = json.loads(json.dumps(line, allow_nan=False))
    assert again["request_rate"] == "inf" and again["max_concurrency"] == 4 and again["completed"] == 2
    assert again["backend"] == "worker" and again["model"] == "tiny" and again["dataset"]["name"] == "random"
    assert [r["status"] for r in again["requests"]] == ["OK", "OK", "RESOURCE_EXHAUSTED", "NOT_SENT"]
    assert again["requests"][0]["itl_ms"] == pytest.approx([100.0])


# ---- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--prompt-format", "text"], "--prompt-format text: needs --model"),
    (["--flush-cache"], "--flush-cache: only with --backend worker"),
    (["--dataset", "shared-prefix", "--prefix-len", "0"], "--prefix-len: must be >= 1"),
    (["--random-range-ratio", "2"], "--random-range-ratio"),
    (["--max-concurrency", "0"], "--max-concurrency: must be >= 1"),
    (["--request-timeout", "0"], "--request-timeout: must be > 0"),
    (["--start-at", "-1"], "--start-at: a Unix time in seconds"),
])
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], message: str, capsys) -> None:
    assert cli_main(["bench-serving", "--address", "127.0.0.1:1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_exits_1_without_a_traceback(capsys) -> None:
    rc = cli_main(["bench-serving", "--address", "127.0.0.1:1", "--num-prompts", "2"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "cannot reach the router at 127.0.0.1:1" in err and "Traceback" not in err
