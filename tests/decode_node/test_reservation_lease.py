"""The reservation's liveness lease and the bound on reservations whose prefill has not started
(design §3a), over the same in-process decode engine as ``test_transfers``.

Time is a fake clock and the reaper is run by hand: what is asserted is the state machine, never
how long anything took.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from decode_node.transfers import AbortCause, RenewRefused, TransferManager, TransferState
from support.fake_clock import FakeClock
from support.transfer_pair import GREEDY, Pair


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pair(tiny_llama_dir: Path, clock: FakeClock):
    pair = Pair(tiny_llama_dir, clock=clock, max_unstarted=2, max_waiting=1, room_poll_s=0.01)
    yield pair
    pair.close()


def test_renewals_keep_a_reservation_past_its_lease_and_silence_expires_it(
    pair: Pair, clock: FakeClock
) -> None:
    async def main() -> None:
        manager = pair.manager
        transfer = await manager.reserve("q", [5, 6, 7, 8], GREEDY, lease_s=10)
        assert transfer is not None
        # The prefill node holds the request in its queue for 5 leases, renewing all along.
        for _ in range(50):
            clock.now += 1
            manager.renew(transfer.transfer_id, started=False)
            await manager.reap()
        assert transfer.state is TransferState.RESERVED
        # Then it stops (died, or SIGSTOP): the lease runs out one lease after its last renew.
        clock.now += 9
        await manager.reap()
        assert transfer.state is TransferState.RESERVED
        clock.now += 2
        await manager.reap()
        assert transfer.state is TransferState.FREED
        assert transfer.abort_cause is AbortCause.LEASE_EXPIRED
        assert manager.counters.expired == 1
        with pytest.raises(RenewRefused, match="unknown or already ended"):
            manager.renew(transfer.transfer_id, started=True)
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())


def test_unstarted_reservations_are_counted_and_capped(pair: Pair) -> None:
    async def main() -> None:
        manager = pair.manager
        a = await manager.reserve("a", [5] * 20, GREEDY, lease_s=10)  # 2 blocks of 16
        b = await manager.reserve("b", [5] * 40, GREEDY, lease_s=10)  # 3 blocks
        assert a is not None and b is not None
        assert manager.unstarted_blocks == 5
        # max_unstarted=2: a third is refused at once, unless it asks to wait.
        assert await manager.reserve("c", [5, 6], GREEDY, lease_s=10) is None
        waiting = asyncio.ensure_future(manager.reserve("d", [5, 6], GREEDY, lease_s=10, wait=True))
        await asyncio.sleep(0.05)
        assert not waiting.done() and manager.num_waiting == 1
        # max_waiting=1: one more waiter is refused, as is anyone not waiting (no queue jumping).
        assert await manager.reserve("e", [5, 6], GREEDY, lease_s=10, wait=True) is None
        # The prefill node starts computing a: its blocks no longer count, and d gets its turn.
        manager.renew(a.transfer_id, started=True)
        assert manager.unstarted_blocks == 3
        d = await asyncio.wait_for(waiting, 10)
        assert d is not None and d.state is TransferState.RESERVED
        assert manager.num_waiting == 0 and manager.counters.waited == 1
        assert manager.unstarted_blocks == 4
        for t in (a, b, d):
            await manager.abort(t.transfer_id, "test", AbortCause.CALLER)
        assert manager.unstarted_blocks == 0
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())


def test_a_waiter_whose_caller_goes_away_leaves_no_blocks(pair: Pair) -> None:
    async def main() -> None:
        manager = pair.manager
        held = [await manager.reserve(f"h{i}", [5, 6], GREEDY, lease_s=10) for i in range(2)]
        waiting = asyncio.ensure_future(manager.reserve("w", [5, 6], GREEDY, lease_s=10, wait=True))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert manager.num_waiting == 0
        for t in held:
            assert t is not None
            await manager.abort(t.transfer_id, "test", AbortCause.CALLER)
        assert manager.transfers == {}
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())


def test_the_bounds_are_validated(pair: Pair) -> None:
    with pytest.raises(ValueError, match="max_unstarted"):
        TransferManager(pair.decode, pair.receiver, max_unstarted=0)
