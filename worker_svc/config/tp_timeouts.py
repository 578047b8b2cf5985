"""The default timeouts of a tensor-parallel group, once: ``llmserve worker``'s flags, the serving ranks
(worker_svc/server/tp_*.py) and ``init_tp`` (worker_svc/parallel/group.py) take them from here. Torch-free,
so the command line can read them on a machine without the worker's dependencies.

Two collective timeouts, because two kinds of group exist:

* a serving group (``llmserve worker --tp``) has heartbeats, and an idle leader sends a keepalive every
  third of the timeout, so the timeout can be short: it is how fast a dead or hung rank is found;
* a group with neither (bench-one-batch, the unit tests' spawned followers): an idle follower waits in a
  broadcast while rank 0 does host work between steps (loading, building a batch), for as long as that
  takes, so the timeout is only a backstop against a hang.
"""

from __future__ import annotations

# Start-up: the rendezvous and the "loaded" barrier (ranks start and load their shards at different speeds).
TP_CONNECT_TIMEOUT_S = 300.0
# Every collective of a serving group, and how soon a dead or hung rank is detected (--tp-timeout).
TP_SERVING_TIMEOUT_S = 15.0
# Every collective of a group without heartbeat or keepalive.
TP_UNWATCHED_TIMEOUT_S = 600.0
