"""argparse types shared by the commands: each rejects a bad value with a message naming the rule."""

from __future__ import annotations

import argparse


def seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def count(text: str) -> int:
    """An integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_count(text: str) -> int:
    """An integer > 0."""
    value = count(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def port_number(text: str) -> int:
    """A TCP port in [0, 65535]."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {text}")
    return value


METRICS_PORT_HELP = ("serve Prometheus metrics at http://HOST:P/metrics, HOST being this service's --host "
                     "(plain HTTP, no auth; docs/metrics.md). Default 0: no metrics")


def add_metrics_port_arg(group: argparse._ActionsContainer, help: str = METRICS_PORT_HELP) -> None:
    group.add_argument("--metrics-port", type=port_number, default=0, metavar="P", help=help)
