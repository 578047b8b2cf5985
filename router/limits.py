"""The router's caps on what one request may ask for, checked before anything is allocated.

Every field a client controls and the router spends memory or event-loop time on has a bound here:
`n` (the router builds per-sequence state for each sample: without a cap `n = 2^31-1` OOM-killed
it), stop strings (matched on the router's single event loop for every text delta, so their count
times length is per-delta work), and the strings the router copies into gRPC metadata and log lines
(`request_id`, `model`: grpc refuses header values that are not printable ASCII, and metadata over
16 KiB). A violation is INVALID_ARGUMENT naming the field and the limit; client strings are never
echoed back whole (validation.echo).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.validation import invalid


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 64  # samples per request (the worker also caps it at its max_running_requests)
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    max_stop_token_ids: int = 256
    max_request_id_chars: int = 256
    max_model_chars: int = 256
    max_messages: int = 4096  # Chat turns

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop_strings", "max_stop_chars", "max_stop_token_ids", "max_request_id_chars",
                     "max_model_chars", "max_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _printable_ascii(text: str) -> bool:
    return text.isascii() and text.isprintable()


def validate_request_id(request_id: str, limits: RequestLimits, field: str = "request_id") -> None:
    """Client request ids become metadata values and log fields: printable ASCII, bounded."""
    if len(request_id) > limits.max_request_id_chars:
        raise invalid(field, f"at most {limits.max_request_id_chars} characters, got {len(request_id)}")
    if not _printable_ascii(request_id):
        bad = next(i for i, ch in enumerate(request_id) if not (ch.isascii() and ch.isprintable()))
        raise invalid(field, f"must be printable ASCII (0x20-0x7e); character {bad} is {request_id[bad]!r}")


def validate_model_name(model: str, limits: RequestLimits) -> None:
    if len(model) > limits.max_model_chars:
        raise invalid("model", f"at most {limits.max_model_chars} characters, got {len(model)}")


def check_sampling_limits(n: int, stops, stop_token_ids, limits: RequestLimits,
                          prefix: str = "sampling_params.") -> None:
    """Count and size caps; the per-value checks are router/validation.py's."""
    if n > limits.max_n:
        raise invalid(f"{prefix}n", f"at most {limits.max_n} samples per request (--max-n), got {n}")
    if len(stops) > limits.max_stop_strings:
        raise invalid(f"{prefix}stop", f"at most {limits.max_stop_strings} stop strings (--max-stop-strings), "
                                       f"got {len(stops)}")
    for i, stop in enumerate(stops):
        if len(stop) > limits.max_stop_chars:
            raise invalid(f"{prefix}stop[{i}]", f"at most {limits.max_stop_chars} characters (--max-stop-chars), "
                                                f"got {len(stop)}")
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise invalid(f"{prefix}stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got {len(stop_token_ids)}")


def check_messages(count: int, limits: RequestLimits, field: str = "messages") -> None:
    if count > limits.max_messages:
        raise invalid(field, f"at most {limits.max_messages} messages, got {count}")
