"""Ports picked for child processes stay out of the range outgoing connections draw from."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from deploy import local_ports


def ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_ports_are_free_distinct_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    ports = local_ports.free_ports(8)
    assert len(set(ports)) == 8
    assert all(not low <= port <= high for port in ports)
    assert all(local_ports.is_free(port) for port in ports)


def test_consecutive_ports_follow_one_base() -> None:
    ports = local_ports.free_ports(6, consecutive=True)
    assert ports == list(range(ports[0], ports[0] + 6))


def test_a_listening_port_is_not_free() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not local_ports.is_free(sock.getsockname()[1])


def test_a_range_that_leaves_no_room_below_picks_above(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    range_file = tmp_path / "range"
    range_file.write_text("10005\t40000\n")
    monkeypatch.setattr(local_ports, "_RANGE_FILE", range_file)
    assert all(port > 40000 for port in local_ports.free_ports(4))
