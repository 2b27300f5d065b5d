"""Opening a process's listening ports with an error a person can act on: a taken port or a
host that is not local ends the process with one line naming the address, not a traceback from
grpc or the socket module. Torch-free, so the gateway can use it."""

from __future__ import annotations

import socket

import grpc


class ListenError(OSError):
    """A port could not be opened; the message names what and where."""


def add_grpc_port(
    server: grpc.aio.Server,
    address: str,
    what: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """``server.add_insecure_port(address)`` (``host:port``), or ``add_secure_port`` with
    ``credentials``; returns the port (the one chosen for port 0)."""
    reason = "the port is in use, or the host is not an address of this machine"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind to address ...")
        raise ListenError(_message(what, address, reason)) from exc
    if not bound:  # older grpc returns 0 instead of raising
        raise ListenError(_message(what, address, reason))
    return bound


def bind_tcp(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), for a server that takes sockets."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise ListenError(_message(what, f"{host}:{port}", reason)) from exc
    return sock


def _message(what: str, address: str, reason: str) -> str:
    return f"cannot listen for {what} on {address}: {reason}"
