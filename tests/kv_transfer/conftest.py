"""Builds transport pairs for the contract suite: every test runs against every transport."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kv_transfer import KvTransport, LoopbackFaults, make_transport

TRANSPORTS = ["loopback", "ucx", "shm"]

PairFactory = Callable[..., tuple[KvTransport, KvTransport]]


@pytest.fixture(params=TRANSPORTS)
def transport_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_pair(transport_name: str) -> Iterator[PairFactory]:
    """`make_pair(src_bytes, dst_bytes) -> (writer, receiver)` with regions "src" (random bytes)
    and "dst" (zeros) registered; the writer is connected. `stalled=True` makes a pair whose
    transfers never complete (loopback and shm: a stall fault; ucx: a receiver whose agent is
    hung); receiver memory comes from `receiver.allocate` (shared memory for shm);
    `pause_before_last_s` makes the writer hold each transfer's last message back."""
    made: list[KvTransport] = []

    def make(
        src_bytes: int = 1 << 20,
        dst_bytes: int = 1 << 20,
        stalled: bool = False,
        pause_before_last_s: float = 0.0,
    ):
        if transport_name == "loopback":
            faults = LoopbackFaults(stall=stalled, pause_before_last_s=pause_before_last_s)
            writer = make_transport("loopback", faults=faults)
        elif transport_name == "shm":
            writer = make_transport("shm", stall=stalled, pause_before_last_s=pause_before_last_s)
        else:
            writer = make_transport(transport_name, pause_before_last_s=pause_before_last_s)
        receiver = make_transport(transport_name)
        made.extend([writer, receiver])
        writer.register("src", np.random.default_rng(0).integers(0, 256, src_bytes, np.uint8))
        receiver.register("dst", receiver.allocate(dst_bytes))
        writer.connect(receiver.address())
        if transport_name == "ucx" and stalled:
            hang_ucx_agent(receiver)
        return writer, receiver

    yield make
    for transport in made:
        transport.close()


def hang_ucx_agent(transport: KvTransport) -> None:
    """Simulates a hung peer process: its agent stops, nothing it receives is ever answered."""
    transport._stop.set()  # type: ignore[attr-defined]
    transport._agent.join(timeout=5)  # type: ignore[attr-defined]
    transport._is_closed = True  # type: ignore[attr-defined]  # close() must not say BYE
