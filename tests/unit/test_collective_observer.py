"""The collective observer (architecture review C5) over a real gloo TP=2 group: every collective a
``TPContext`` performs reaches its observer with the op, bytes, shape and issue <= wait <= done; async
handles record when waited for; a context without an observer gives the same numbers; a TP=2 model
step shows the step broadcast, the embedding's all-reduce, two all-reduces per layer (attention and
MLP) and the LM head's all-gather.

The pytest process is rank 0; rank 1 is spawned once, runs the same collectives, then replays the
leader's model steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from llmserve.bench.driver import StaticBatch
from worker_svc.config.engine_config import EngineConfig
from worker_svc.executor.model_runner import ModelRunner
from worker_svc.executor.tp_runners import FollowerLoop, LeaderRunner, join_followers
from worker_svc.parallel.collective_observer import CollectiveRecord, CollectiveRecorder
from worker_svc.parallel.context import TPContext
from worker_svc.parallel.group import destroy_tp, free_port, init_tp, tp_barrier
from worker_svc.parallel.step_broadcast import HEADER_LEN

SIZE = 2
TIMEOUT_S = 60
LOAD_TIMEOUT_S = 900  # a rank's model load may wait on the shared kernel build on a busy machine
ASYNC_GAP_S = 0.02  # work the leader does between issuing an async collective and waiting for it
# The tiny preset: 2 layers, hidden 64, vocabulary 512 (256 per rank at TP=2).
LAYERS, HIDDEN, VOCAB_PER_RANK = 2, 64, 256
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def _engine(model_dir: Path) -> EngineConfig:
    return EngineConfig(model_path=str(model_dir), dtype="float32", max_total_tokens=256, max_running_requests=4)


def _ops(tp: TPContext, between: Callable[[], None] = lambda: None) -> dict[str, torch.Tensor]:
    """One of each collective the context offers, sync and async; every rank calls it identically.
    ``between`` runs after each async collective is issued and before it is waited for."""
    r = float(tp.rank + 1)
    summed = torch.full((4, 3), r)
    tp.all_reduce(summed)
    summed_async = torch.arange(6.0).reshape(2, 3) * r
    work = tp.all_reduce(summed_async, async_op=True)
    between()
    work.wait()
    work.wait()  # waiting twice records once
    maxed = torch.tensor([r, -r, 5.0])
    tp.all_reduce_max(maxed)
    gathered = tp.all_gather_last_dim(torch.full((2, 2), r))
    sent = torch.full((5,), tp.rank, dtype=torch.int64)
    tp.broadcast(sent)
    sent_async = torch.full((3, 2), 7 * tp.rank, dtype=torch.int64)
    work = tp.broadcast(sent_async, async_op=True)
    between()
    work.wait()
    return {"summed": summed, "summed_async": summed_async, "maxed": maxed, "gathered": gathered,
            "sent": sent, "sent_async": sent_async}


def _follower(index: int, init_addr: str, engine: EngineConfig) -> None:
    tp = init_tp(index + 1, SIZE, init_addr, "cpu", timeout_s=TIMEOUT_S)
    try:
        _ops(tp)  # the leader's observed run
        _ops(tp)  # its plain run
        runner = ModelRunner(engine, tp)
        tp_barrier(tp, "loaded", LOAD_TIMEOUT_S)
        FollowerLoop(runner, tp).run()
    finally:
        destroy_tp(tp)


@pytest.fixture(scope="module")
def group_run(tiny_model) -> dict:
    """Everything the leader saw, run once over one TP=2 group."""
    import torch.multiprocessing as mp

    engine = _engine(tiny_model)
    addr = f"127.0.0.1:{free_port()}"
    followers = mp.spawn(_follower, args=(addr, engine), nprocs=SIZE - 1, join=False)
    tp = init_tp(0, SIZE, addr, "cpu", timeout_s=TIMEOUT_S)
    out: dict = {}
    try:
        recorder = CollectiveRecorder()
        observed = dataclasses.replace(tp, observer=recorder)
        recorded_before_wait: list[int] = []

        def between() -> None:
            recorded_before_wait.append(len(recorder.records))
            time.sleep(ASYNC_GAP_S)

        out["observed"] = _ops(observed, between)
        out["records"] = recorder.records
        out["recorded_before_wait"] = recorded_before_wait
        out["plain"] = _ops(tp)
        out["records_after_plain"] = len(recorder.records)

        model_recorder = CollectiveRecorder()
        model_tp = dataclasses.replace(tp, observer=model_recorder)
        runner = LeaderRunner(ModelRunner(engine, model_tp), model_tp)
        tp_barrier(tp, "loaded", LOAD_TIMEOUT_S)  # no step is sent (and timed out) before rank 1 has loaded
        try:
            model_recorder.clear()  # loading an unquantized model performs none; the steps are what counts
            batch = StaticBatch(runner, len(PROMPTS))
            try:
                logits = batch.extend(PROMPTS)
                out["extend"] = model_recorder.records
                model_recorder.clear()
                batch.decode(logits.argmax(dim=-1))
                out["decode"] = model_recorder.records
                out["decode_summary"] = model_recorder.summary()
            finally:
                batch.release()
        finally:
            runner.stop_followers()
    finally:
        destroy_tp(tp)
        join_followers(followers, TIMEOUT_S)
    return out


def _ordered(rec: CollectiveRecord) -> bool:
    return rec.issue_ns <= rec.wait_ns <= rec.done_ns


def test_every_collective_is_recorded_with_op_bytes_shape_and_times(group_run):
    records = group_run["records"]
    expected = [  # (op, shape, dtype, async)
        ("all_reduce", (4, 3), torch.float32, False),
        ("all_reduce", (2, 3), torch.float32, True),
        ("all_reduce_max", (3,), torch.float32, False),
        ("all_gather", (2, 2), torch.float32, False),
        ("broadcast", (5,), torch.int64, False),
        ("broadcast", (3, 2), torch.int64, True),
    ]
    assert [(r.op, r.shape, r.dtype, r.async_op) for r in records] == expected
    for rec in records:
        assert rec.nbytes == torch.Size(rec.shape).numel() * torch.empty((), dtype=rec.dtype).element_size()
        assert _ordered(rec), rec
    for rec in records:
        if not rec.async_op:
            assert rec.wait_ns == rec.issue_ns  # a synchronous call waits at once
        else:  # wait is when the caller waited, after its own work
            assert rec.wait_ns - rec.issue_ns >= ASYNC_GAP_S * 1e9
            assert rec.blocked_ns < rec.span_ns


def test_async_collective_is_recorded_when_waited_for(group_run):
    # Before each async wait, only the collectives already finished were recorded: 1, then 5.
    assert group_run["recorded_before_wait"] == [1, 5]


def test_results_are_right_and_the_same_without_an_observer(group_run):
    observed, plain = group_run["observed"], group_run["plain"]
    assert torch.equal(observed["summed"], torch.full((4, 3), 3.0))
    assert torch.equal(observed["summed_async"], torch.arange(6.0).reshape(2, 3) * 3)
    assert torch.equal(observed["maxed"], torch.tensor([2.0, -1.0, 5.0]))
    assert torch.equal(observed["gathered"], torch.tensor([[1.0, 1.0, 2.0, 2.0]] * 2))
    assert torch.equal(observed["sent"], torch.zeros(5, dtype=torch.int64))
    assert torch.equal(observed["sent_async"], torch.zeros(3, 2, dtype=torch.int64))
    for name, value in observed.items():
        assert torch.equal(value, plain[name]), name
    # The plain context reported to no one.
    assert group_run["records_after_plain"] == len(group_run["records"])


def _expected_step(tokens: int, requests: int) -> list[tuple[str, tuple[int, ...]]]:
    """The leader's collectives in one TP=2 step of the tiny llama, in order."""
    return (
        [("broadcast", (HEADER_LEN,)), ("broadcast", (3 * tokens + 3 * requests,))]  # the step message: header, payload
        + [("all_reduce", (tokens, HIDDEN))]  # vocab-parallel embedding
        + [("all_reduce", (tokens, HIDDEN))] * (2 * LAYERS)  # per layer: o_proj (attention), down_proj (MLP)
        + [("all_gather", (requests, VOCAB_PER_RANK))]  # LM head, last token of each request
    )


def test_model_step_shows_two_all_reduces_per_layer(group_run):
    tokens = sum(len(p) for p in PROMPTS)
    assert [(r.op, r.shape) for r in group_run["extend"]] == _expected_step(tokens, len(PROMPTS))
    assert [(r.op, r.shape) for r in group_run["decode"]] == _expected_step(len(PROMPTS), len(PROMPTS))
    assert all(_ordered(r) and not r.async_op for r in group_run["extend"] + group_run["decode"])
    summary = group_run["decode_summary"]
    assert list(summary) == ["broadcast", "all_reduce", "all_gather"]
    assert summary["all_reduce"].count == 2 * LAYERS + 1
    assert summary["all_reduce"].nbytes == (2 * LAYERS + 1) * len(PROMPTS) * HIDDEN * 4
    assert summary["all_gather"].count == 1 and summary["broadcast"].count == 2


# ---- without a group ------------------------------------------------------------------------------


def test_a_single_rank_performs_and_records_nothing():
    recorder = CollectiveRecorder()
    tp = TPContext(observer=recorder)
    t = torch.ones(3)
    assert tp.all_reduce(t) is None and tp.all_reduce(t, async_op=True) is None
    tp.all_reduce_max(t)
    assert tp.all_gather_last_dim(t) is t
    assert tp.broadcast(t) is None
    assert recorder.records == [] and recorder.summary() == {}
    assert torch.equal(t, torch.ones(3))


def test_observer_is_not_part_of_the_contexts_identity():
    assert TPContext(observer=CollectiveRecorder()) == TPContext()


def test_recorder_summary_counts_bytes_and_times_per_op():
    recorder = CollectiveRecorder()
    recorder.record(CollectiveRecord("all_reduce", 100, (25,), torch.float32, False, 0, 0, 40))
    recorder.record(CollectiveRecord("broadcast", 32, (4,), torch.int64, False, 50, 50, 60))
    recorder.record(CollectiveRecord("all_reduce", 300, (75,), torch.float32, True, 100, 150, 160))
    summary = recorder.summary()
    assert list(summary) == ["all_reduce", "broadcast"]
    reduce = summary["all_reduce"]
    assert (reduce.count, reduce.nbytes, reduce.total_ns, reduce.blocked_ns, reduce.mean_ns) == (2, 400, 100, 50, 50.0)
    assert (summary["broadcast"].count, summary["broadcast"].total_ns) == (1, 10)
    recorder.clear()
    assert recorder.records == [] and recorder.summary() == {}

