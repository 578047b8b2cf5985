"""grpc.health.v1 of a worker rank: the overall status ("") and SglangScheduler, refreshed from the rank's
liveness on every Check. Rank 0 serves it beside the scheduler (app.py), a tensor-parallel follower
alone (tp_follower.py)."""

from __future__ import annotations

from collections.abc import Callable

from llmserve.grpc_server import ServiceHealth
from worker_svc.server.servicer import SERVICE_NAME


class WorkerHealth(ServiceHealth):
    def __init__(self, liveness: Callable[[], tuple[bool, str]]) -> None:
        """``liveness``: (ok, why) of the rank now; cheap, it runs on the event loop."""
        super().__init__(SERVICE_NAME)
        self._liveness = liveness

    async def Check(self, request, context):  # noqa: N802 - gRPC method name
        ok, _ = self._liveness()
        await self.set_serving(ok)
        return await super().Check(request, context)
