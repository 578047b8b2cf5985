"""Binding a grpc.aio server to host:port, shared by the router, tokenizer and worker services."""

from __future__ import annotations

import grpc


def grpc_address(host: str, port: int) -> str:
    """host:port as gRPC wants it (IPv6 literals bracketed)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def listen(server: grpc.aio.Server, host: str, port: int) -> int:
    """Add an insecure port (0 picks a free one) and return the bound port; OSError when it cannot bind."""
    bound = server.add_insecure_port(grpc_address(host, port))
    if not bound:
        raise OSError(f"cannot listen on {grpc_address(host, port)}")
    return bound
