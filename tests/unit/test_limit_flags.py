"""The limit flags: `serve` takes the router's and the workers' and hands them on unchanged."""

from __future__ import annotations

import argparse

from llmserve.commands.router import add_limit_args, limit_argv
from llmserve.commands.worker import add_worker_limit_args, worker_limit_argv


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_limit_args(p)
    return p.parse_args(argv)


def test_limit_flags_round_trip_through_limit_argv() -> None:
    given = _parse(["--max-concurrent-requests", "7", "--max-requests-per-client", "3", "--max-n", "4",
                    "--max-stop-strings", "2", "--max-stop-chars", "9", "--stream-timeout", "1.5", "--log-prompts"])
    assert vars(_parse(limit_argv(given))) == vars(given)
    defaults = _parse([])
    assert (defaults.max_concurrent_requests, defaults.max_n, defaults.stream_timeout, defaults.log_prompts) == \
        (256, 64, 60.0, False)
    assert vars(_parse(limit_argv(defaults))) == vars(defaults)


def _parse_worker_limits(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_worker_limit_args(p.add_argument_group())
    return p.parse_args(argv)


def test_worker_limit_flags_round_trip_through_worker_limit_argv() -> None:
    given = _parse_worker_limits(["--step-stall-timeout", "7.5", "--malloc-mmap-threshold", "4194304",
                                  "--max-queued-requests", "9"])
    assert vars(_parse_worker_limits(worker_limit_argv(given))) == vars(given)
    defaults = _parse_worker_limits([])
    assert (defaults.step_stall_timeout, defaults.malloc_mmap_threshold, defaults.max_queued_requests) == \
        (120.0, "keep", 1024)


def test_serve_hands_the_worker_limits_to_its_workers() -> None:
    from llmserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "m", "--max-queued-requests", "5",
                                      "--step-stall-timeout", "3", "--malloc-mmap-threshold", "1048576"])
    assert worker_limit_argv(args) == ["--step-stall-timeout=3.0", "--malloc-mmap-threshold=1048576",
                                       "--max-queued-requests=5"]
    worker = build_parser().parse_args(["worker", "--model", "m", *worker_limit_argv(args)])
    assert (worker.step_stall_timeout, worker.malloc_mmap_threshold, worker.max_queued_requests) == (3.0, 1048576, 5)
