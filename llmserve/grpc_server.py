"""What every llmserve gRPC server does the same way: the router, the tokenizer service, the worker and a
tensor-parallel follower's health server.

* ``listen``: bind host:port (TLS or plaintext, warning when plaintext leaves loopback);
* ``add_service``: register a service's method handlers (ours are built by hand, with tolerant
  deserializers, instead of the generated add_..._to_server);
* ``grpc_address``: host:port as gRPC and the command lines write it (IPv6 bracketed);
* ``metadata_value``, ``REQUEST_ID_HEADER``, ``CLIENT_REQUEST_ID_HEADER``: the request-id metadata that
  links one client call's log lines across the services;
* ``write_port_file``: the bound port, written atomically once the server accepts calls;
* ``stop_signal_event``: the SIGINT/SIGTERM a server runs until;
* ``ServiceHealth``: grpc.health.v1 whose overall status ("") and named services move together.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from llmserve.logging import get_logger
from llmserve.security import ServerTls

log = get_logger(__name__)

# The caller's label for a call, logged by every service it reaches (the router sends its engine id
# to a worker under this key, and the client's own label under CLIENT_REQUEST_ID_HEADER).
REQUEST_ID_HEADER = "x-request-id"
CLIENT_REQUEST_ID_HEADER = "x-client-request-id"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def grpc_address(host: str, port: int) -> str:
    """host:port as gRPC wants it (IPv6 literals bracketed)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen(server: grpc.aio.Server, host: str, port: int, tls: ServerTls | None = None) -> int:
    """Add a port (TLS when `tls` is given, else plaintext; 0 picks a free one) and return the bound
    port; OSError when it cannot bind."""
    address = grpc_address(host, port)
    if tls is not None:
        bound = server.add_secure_port(address, tls.credentials())
    else:
        if not is_loopback(host):
            log.warning("listening without TLS on a non-loopback address; pass --tls-cert/--tls-key",
                        address=address)
        bound = server.add_insecure_port(address)
    if not bound:
        raise OSError(f"cannot listen on {address}")
    return bound


def add_service(server: grpc.aio.Server, service_name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    """Register ``handlers`` (method name -> handler) as ``service_name``, as the generated
    add_..._to_server does."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str:
    """The call's first metadata value under ``key``; "" when it has none."""
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode(errors="replace")
    return ""


def write_port_file(path: str | Path, port: int) -> None:
    """Write ``port`` to ``path`` through a rename, so a reader never sees a half-written file."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, target)


def stop_signal_event() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets (handlers on the running loop; call it from the loop's thread,
    the main one). Others may set it too, to stop the server the same way."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    return stop


class ServiceHealth(health_aio.HealthServicer):
    """grpc.health.v1 for one server: the overall status ("") and every service it names say the same."""

    def __init__(self, *services: str) -> None:
        super().__init__()
        self.services = ("", *services)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in self.services:
            await self.set(service, status)
