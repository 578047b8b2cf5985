"""Binding a grpc.aio server to host:port, shared by the router, tokenizer and worker services."""

from __future__ import annotations

import ipaddress

import grpc

from llmserve.logging import get_logger
from llmserve.security import ServerTls

log = get_logger(__name__)


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
