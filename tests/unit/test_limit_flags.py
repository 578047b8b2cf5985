"""The router's limit flags: `serve` takes them and hands them to its router unchanged."""

from __future__ import annotations

import argparse

from llmserve.router_command import add_limit_args, limit_argv


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
