"""One bound on gRPC message size for every llmserve server and channel.

A prompt the router accepts must also fit the tokenizer service and the worker: with different
limits a 5 MiB text passed the router and came back from the tokenizer as a retryable UNAVAILABLE.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 << 20


def message_size_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """grpc server / channel options setting both directions to ``max_bytes``."""
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]
