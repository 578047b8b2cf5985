"""The one range check of token ids, for every service that takes ids from a client or a worker."""

from __future__ import annotations

from collections.abc import Sequence


def first_out_of_range(ids: Sequence[int], vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first id outside [0, vocab_size), or None when all are inside."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # C-speed common case
        return None
    return next((pos, i) for pos, i in enumerate(ids) if not 0 <= i < vocab_size)
