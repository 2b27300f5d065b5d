"""A port that cannot be opened ends a process with one line naming it, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.listen import ListenError, add_grpc_port, bind_tcp


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_bind_tcp_names_the_taken_address(taken_port: int) -> None:
    with pytest.raises(ListenError, match=f"the HTTP API on 127.0.0.1:{taken_port}: .*in use"):
        bind_tcp("127.0.0.1", taken_port, "the HTTP API")
    sock = bind_tcp("127.0.0.1", 0, "the HTTP API")
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_add_grpc_port_names_the_taken_address(taken_port: int) -> None:
    server = grpc.server(thread_pool=None)  # only ports are added; it never starts
    with pytest.raises(ListenError, match=f"gRPC on 127.0.0.1:{taken_port}"):
        add_grpc_port(server, f"127.0.0.1:{taken_port}", "gRPC")
    assert add_grpc_port(server, "127.0.0.1:0", "gRPC") > 0


def run_module(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120
    )


def test_gateway_on_a_taken_port_exits_1_with_one_line(
    tiny_llama_dir: Path, taken_port: int
) -> None:
    result = run_module(
        ["gateway", "--model", str(tiny_llama_dir), "--host", "127.0.0.1",
         "--http-port", str(taken_port), "--grpc-port", "0", "--colocated", "127.0.0.1:1"]
    )  # fmt: skip
    assert result.returncode == 1
    assert f"cannot listen for the HTTP API on 127.0.0.1:{taken_port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_node_on_a_taken_port_exits_1_with_one_line(tiny_llama_dir: Path, taken_port: int) -> None:
    result = run_module(
        ["decode_node", "--role", "colocated", "--model", str(tiny_llama_dir),
         "--host", "127.0.0.1", "--grpc-port", str(taken_port), "--kv-transport", "loopback",
         "--kv-cache-memory", "16MiB"]
    )  # fmt: skip
    assert result.returncode == 1
    assert f"cannot listen for gRPC on 127.0.0.1:{taken_port}" in result.stderr
    assert "Traceback" not in result.stderr
