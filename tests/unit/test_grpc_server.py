"""llmserve/grpc_server.py: the pieces every server shares (the x-request-id metadata is covered end to end
by the router, tokenizer service and worker tests)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from grpc_health.v1 import health_pb2

from llmserve.grpc_server import ServiceHealth, grpc_address, write_port_file


def test_port_file_is_replaced_whole(tmp_path: Path) -> None:
    target = tmp_path / "worker.port"
    write_port_file(target, 30001)
    write_port_file(str(target), 45678)
    assert target.read_text() == "45678\n"
    assert [p.name for p in tmp_path.iterdir()] == ["worker.port"]  # no temporary left behind


def test_grpc_address_brackets_ipv6() -> None:
    assert grpc_address("127.0.0.1", 1) == "127.0.0.1:1"
    assert grpc_address("::1", 2) == "[::1]:2"
    assert grpc_address("[::1]", 3) == "[::1]:3"


def test_health_moves_every_service_together() -> None:
    async def statuses(serving: bool) -> list[int]:
        health = ServiceHealth("pkg.A", "pkg.B")
        await health.set_serving(serving)
        return [(await health.Check(health_pb2.HealthCheckRequest(service=name), None)).status
                for name in ("", "pkg.A", "pkg.B")]

    assert asyncio.run(statuses(True)) == [health_pb2.HealthCheckResponse.SERVING] * 3
    assert asyncio.run(statuses(False)) == [health_pb2.HealthCheckResponse.NOT_SERVING] * 3
