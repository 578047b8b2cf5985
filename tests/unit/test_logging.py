"""llmserve.logging: tracebacks never carry frame locals (review F9: request contents, prompt text
included, were dumped with every unhandled exception), in JSON and console modes."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

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
        _unconfigure()


def _unconfigure() -> None:
    """Back to structlog's defaults: configure_logging bound capsys's stream, which closes after the test."""
    logging.getLogger().handlers.clear()
    structlog.reset_defaults()


@pytest.mark.parametrize("json_mode", [True, False])
def test_structlog_and_library_lines_share_the_format_and_the_level(json_mode: bool, capsys) -> None:
    configure_logging(json=json_mode, level="info")
    try:
        with structlog.contextvars.bound_contextvars(request_id="r-1"):
            get_logger("router.server").info("generate routed", group=0)
            get_logger("router.server").debug("below the level")
            logging.getLogger("grpc._cython").warning("a library line")
            logging.getLogger("grpc._cython").debug("a library line below the level")
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 2, lines
        if json_mode:
            ours, library = (json.loads(line) for line in lines)
            assert ours["event"] == "generate routed" and ours["logger"] == "router.server"
            assert ours["level"] == "info" and ours["request_id"] == "r-1" and ours["group"] == 0
            assert library["event"] == "a library line" and library["logger"] == "grpc._cython"
            assert library["level"] == "warning" and library["request_id"] == "r-1"
        else:
            assert "generate routed" in lines[0] and "[router.server]" in lines[0] and "request_id=r-1" in lines[0]
            assert "a library line" in lines[1] and "[grpc._cython]" in lines[1] and "warning" in lines[1]
    finally:
        _unconfigure()
