"""Free TCP ports for processes a test or benchmark is about to start.

A port found by binding port 0 comes from the kernel's ephemeral range, the same range every
outgoing connection takes its source port from. Between picking it and the child binding it,
another process's connection (a gateway dialling its nodes, a UCX endpoint) can take it, and
the child dies with "Address already in use". Ports outside the ephemeral range are never
handed out that way, so only another listener can race us for them, which a random start makes
rare.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below here live well-known service ports
_DEFAULT_EPHEMERAL = (32_768, 60_999)  # Linux's default when the range cannot be read


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(word) for word in _RANGE_FILE.read_text().split()[:2])
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def _candidate_starts(count: int) -> range:
    """First ports from which ``count`` ports fit below, or else above, the ephemeral range."""
    low, high = _ephemeral_range()
    below = range(_LOWEST, low - count)
    above = range(high + 1, 65_536 - count)
    return below if len(below) >= len(above) else above


def is_free(port: int) -> bool:
    """True when nothing listens on ``port`` on any local address."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_ports(count: int, *, consecutive: bool = False) -> list[int]:
    """``count`` distinct free ports outside the ephemeral range, ascending when consecutive.

    ``consecutive`` is for a topology that numbers its nodes from one base port.
    """
    starts = _candidate_starts(count)
    if len(starts) < count:
        raise RuntimeError(f"no room for {count} ports outside the ephemeral range")
    rng = random.SystemRandom()
    for _ in range(1000):
        if consecutive:
            base = rng.choice(starts)
            ports = list(range(base, base + count))
        else:
            ports = sorted(rng.sample(starts, count))
        if all(is_free(port) for port in ports):
            return ports
    raise RuntimeError(f"found no {count} free ports outside the ephemeral range")
