"""A control for the load test's burst (tests/integration/test_router_load.py): a grpc.aio server with the
Router service whose Generate refuses every call at once with RESOURCE_EXHAUSTED, doing nothing else. The
same burst against it measures what the client process, the loopback and grpc.aio's call intake cost
before any router code runs.

    python -m tests.integration.refusing_router   # prints "port N", serves until killed
"""

from __future__ import annotations

import asyncio

import grpc

from llmserve.v1 import router_pb2_grpc as pb_grpc


class RefusingRouter(pb_grpc.RouterServicer):
    async def Generate(self, request, context):  # noqa: N802 - the gRPC method's name
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "control: every call is refused")
        yield  # never reached; makes this a server-streaming handler


async def _main() -> None:
    server = grpc.aio.server()
    pb_grpc.add_RouterServicer_to_server(RefusingRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"port {port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_main())
