"""llmserve.logging: tracebacks never carry frame locals (review F9: request contents, prompt text
included, were dumped with every unhandled exception), in JSON and console modes."""

from __future__ import annotations

import json
import logging

import pytest

from llmserve.logging import configure_logging, get_logger

SECRET = "the-user's-private-prompt-text"


def _fail_with_a_local() -> None:
    prompt = SECRET  # noqa: F841 - a local the old renderers printed
    raise ValueError("boom")


@pytest.mark.parametrize("json_mode", [True, False])
def test_tracebacks_carry_no_locals(json_mode: bool, capsys) -> None:
    configure_logging(json=json_mode, level="info")
    try:
        try:
            _fail_with_a_local()
        except ValueError:
            get_logger("test").exception("request failed")
        err = capsys.readouterr().err
        assert "ValueError" in err and "_fail_with_a_local" in err  # the traceback itself is kept
        assert SECRET not in err
        if json_mode:
            record = json.loads(err.strip().splitlines()[-1])
            assert record["event"] == "request failed" and "exception" in record
    finally:
        logging.getLogger().handlers.clear()
