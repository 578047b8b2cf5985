"""What the router and the worker agree on beyond sglang's SglangScheduler proto. Both import it from
here: the router must not import worker_svc (the light side installs without torch).

* Caps on sampling fields, so the router refuses at its edge exactly what a worker would.
* How Abort addresses one sample of an n > 1 call: ``sample_label(request_id, i)``. The worker files
  sample ``i`` under it (worker_svc/server/calls.py); the router aborts the one sample whose stop
  string matched by it.
"""

from __future__ import annotations

# Largest number of alternatives a request may ask for per position (OpenAI's API allows 20).
MAX_TOP_LOGPROBS = 20
# frequency_penalty and presence_penalty lie in [-MAX_ABS_PENALTY, MAX_ABS_PENALTY] (OpenAI's range).
MAX_ABS_PENALTY = 2.0


def sample_label(request_id: str, index: int) -> str:
    """The label of sample ``index`` of the call ``request_id`` (calls with n > 1)."""
    return f"{request_id}-n{index}"
