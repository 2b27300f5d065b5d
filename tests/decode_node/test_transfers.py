"""The decode side's KV transfer state machine over the loopback transport.

A prefill engine in the same process plays the prefill node: it computes each prompt with
``hold_kv`` and pushes its pages through a loopback transport into the blocks the decode node's
TransferManager reserved.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from decode_node.servicer import DecodeServicer
from decode_node.transfers import AbortCause, CommitRefused, TransferState
from kv_transfer import LoopbackFaults
from pdserve.v1 import decode_pb2
from services.engine import LLM, FinishReason
from services.types import StageTimings
from support.fake_clock import FakeClock
from support.transfer_pair import GREEDY, Pair


@pytest.fixture
def pair(tiny_llama_dir: Path):
    pair = Pair(tiny_llama_dir)
    yield pair
    pair.close()


def test_reserve_push_commit_streams_the_single_engine_tokens(pair: Pair, tiny_llama_dir) -> None:
    prompt = list(range(200, 250))
    [expected] = LLM(tiny_llama_dir, dtype="float32", max_model_len=256).generate([prompt], GREEDY)

    async def main() -> list[int]:
        transfer = await pair.manager.reserve("r1", prompt, GREEDY, lease_s=10)
        assert transfer is not None and transfer.state is TransferState.RESERVED
        first = pair.first_token("r1", prompt)
        handle = pair.push("r1", transfer)
        assert await handle.wait_async(5) is not None and handle.status.value == "done"
        pair.prefill.release_kv("r1")
        stream = await pair.decode.attach("r1")
        prefill = StageTimings(prefill_queue_s=0.25, prefill_compute_s=0.5, kv_transfer_s=0.125)
        await pair.manager.commit(
            transfer.transfer_id, first, cached_prompt_tokens=32, prefill_timings=prefill
        )
        assert transfer.state is TransferState.COMMITTED and not pair.manager.transfers
        # What the decode stream reports at its end comes with the transfer.
        assert transfer.cached_prompt_tokens == 32 and transfer.prefill_timings == prefill
        assert transfer.committed_at is not None
        tokens = [first]
        async for out in stream:
            tokens.extend(out.new_token_ids)
        return tokens

    assert asyncio.run(main()) == expected.token_ids
    assert pair.prefill.stats().num_blocks_used == 0
    assert asyncio.run(pair.decode_blocks_used()) == 0


def test_a_commit_before_the_pages_landed_is_refused_and_frees(pair: Pair) -> None:
    async def main() -> None:
        transfer = await pair.manager.reserve("early", [5, 6, 7], GREEDY, lease_s=10)
        with pytest.raises(CommitRefused, match="pages not all received"):
            await pair.manager.commit(transfer.transfer_id, 11)
        assert transfer.state is TransferState.FREED
        assert await pair.decode_blocks_used() == 0
        with pytest.raises(CommitRefused, match="unknown or already freed"):
            await pair.manager.commit(transfer.transfer_id, 11)

    asyncio.run(main())


def test_an_expired_lease_is_freed_and_a_late_write_never_lands(pair: Pair) -> None:
    prompt = list(range(300, 340))

    async def main() -> None:
        transfer = await pair.manager.reserve("slow", prompt, GREEDY, lease_s=0.0)
        await pair.manager.reap()
        assert transfer.state is TransferState.FREED and pair.manager.counters.expired == 1
        assert await pair.decode_blocks_used() == 0
        # The prefill node finishes late and pushes anyway: the fenced id is refused.
        pair.first_token("slow", prompt)
        before = [cache.clone() for cache in pair.decode.engine.kv_caches]
        handle = pair.push("slow", transfer)
        assert handle.wait(5).value != "done"
        after = pair.decode.engine.kv_caches
        assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
        pair.prefill.release_kv("slow")

    asyncio.run(main())


def test_aborting_mid_transfer_fences_before_freeing(tiny_llama_dir: Path) -> None:
    pair = Pair(tiny_llama_dir, LoopbackFaults(stall=True))
    prompt = list(range(400, 480))
    try:

        async def main() -> None:
            transfer = await pair.manager.reserve("cut", prompt, GREEDY, lease_s=10)
            pair.first_token("cut", prompt)
            handle = pair.push("cut", transfer)
            while pair.receiver.inbound_status(transfer.transfer_id) is None:
                await asyncio.sleep(0.005)  # until the push has started (it never finishes)
            assert not handle.status.is_terminal
            await pair.manager.abort_request("cut", "client disconnected", AbortCause.CALLER)
            assert transfer.state is TransferState.FREED
            assert await pair.decode_blocks_used() == 0
            status = await handle.wait_async(5)
            assert status.is_terminal and status.value != "done"
            pair.prefill.release_kv("cut")

        asyncio.run(main())
    finally:
        pair.close()


class StubbornFence:
    """Wraps a transport whose fence reports writes in flight the first ``busy`` times."""

    def __init__(self, inner, busy: int) -> None:
        self.inner, self.busy = inner, busy

    def fence(self, transfer_id: str, timeout: float) -> bool:
        if self.busy:
            self.busy -= 1
            return False
        return self.inner.fence(transfer_id, timeout)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_blocks_stay_quarantined_until_the_fence_succeeds(pair: Pair) -> None:
    pair.manager.transport = StubbornFence(pair.receiver, busy=2)

    async def main() -> None:
        transfer = await pair.manager.reserve("q", [5, 6, 7, 8], GREEDY, lease_s=10)
        await pair.manager.abort(transfer.transfer_id, "test", AbortCause.CALLER)
        assert transfer.state is TransferState.ABORTED and pair.manager.num_quarantined == 1
        assert await pair.decode_blocks_used() > 0  # never reused while a write may land
        await pair.manager.reap()  # second refusal
        assert await pair.decode_blocks_used() > 0
        await pair.manager.reap()
        assert transfer.state is TransferState.FREED and await pair.decode_blocks_used() == 0
        assert pair.manager.counters.fence_retries == 2

    asyncio.run(main())


def test_no_room_is_none_and_an_attached_stream_ends_on_abort(pair: Pair) -> None:
    async def main() -> None:
        transfers = []
        while t := await pair.manager.reserve(
            f"fill{len(transfers)}", [7] * 200, GREEDY, lease_s=10
        ):
            transfers.append(t)
        assert transfers  # some fitted, then the engine said no
        stream = await pair.decode.attach(transfers[0].request_id)
        for t in transfers:
            await pair.manager.abort(t.transfer_id, "test", AbortCause.CALLER)
        outputs = [out async for out in stream]
        assert outputs[-1].finish_reason is FinishReason.ABORT
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())


def test_the_transport_forgets_ended_transfers(pair: Pair) -> None:
    async def main() -> None:
        for i in range(3):
            transfer = await pair.manager.reserve(f"f{i}", [5, 6, 7], GREEDY, lease_s=10)
            await pair.manager.abort(transfer.transfer_id, "test", AbortCause.CALLER)
            assert pair.receiver.inbound_status(transfer.transfer_id) is None

    asyncio.run(main())


def test_a_closed_stream_never_frees_reserved_blocks_before_the_fence(pair: Pair) -> None:
    """The consumer of a reserved request's stream going away must not free its blocks: the
    prefill node may still be writing. Only the transfer's own abort frees them, after a fence."""
    pair.manager.transport = StubbornFence(pair.receiver, busy=1)

    async def main() -> None:
        transfer = await pair.manager.reserve("closed", [5, 6, 7, 8], GREEDY, lease_s=10)
        stream = await pair.decode.attach("closed")
        # A consumer waiting inside the stream (as the servicer's is) goes away.
        consumer = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.02)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await pair.decode.call(lambda e: None)  # let the engine thread run the abandon command
        assert transfer.state is TransferState.RESERVED
        assert await pair.decode_blocks_used() > 0
        # The fence refuses once.
        await pair.manager.abort(transfer.transfer_id, "stream closed", AbortCause.CALLER)
        assert await pair.decode_blocks_used() > 0
        await pair.manager.reap()
        assert transfer.state is TransferState.FREED and await pair.decode_blocks_used() == 0

    asyncio.run(main())


def test_abort_request_fences_a_reserved_request(pair: Pair) -> None:
    async def main() -> None:
        transfer = await pair.manager.reserve("ab", [5, 6, 7, 8], GREEDY, lease_s=10)
        assert await pair.manager.abort_request("ab", "caller", AbortCause.CALLER)
        assert transfer.state is TransferState.FREED and await pair.decode_blocks_used() == 0
        assert not await pair.manager.abort_request("ab", "again", AbortCause.CALLER)

    asyncio.run(main())


def test_each_abort_records_its_cause(pair: Pair) -> None:
    """The servicer recomputes after a failed handoff, never after the caller's own abort: the
    cause tells them apart."""

    async def main() -> None:
        caller = await pair.manager.reserve("c", [5, 6, 7], GREEDY, lease_s=10)
        await pair.manager.abort_request("c", "stream closed", AbortCause.CALLER)
        expired = await pair.manager.reserve("e", [5, 6, 7], GREEDY, lease_s=0.0)
        await pair.manager.reap()
        early = await pair.manager.reserve("b", [5, 6, 7], GREEDY, lease_s=10)
        with pytest.raises(CommitRefused):
            await pair.manager.commit(early.transfer_id, 11)
        assert caller.abort_cause is AbortCause.CALLER and not caller.abort_cause.is_failure
        assert expired.abort_cause is AbortCause.LEASE_EXPIRED
        assert early.abort_cause is AbortCause.BAD_COMMIT
        assert all(t.abort_cause.is_failure for t in (expired, early))
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())


def test_a_failed_push_is_aborted_at_once_not_at_its_lease(tiny_llama_dir: Path) -> None:
    """The writer failing its push ends the transfer at the next reap, long before a 60 s lease
    would: a failure reaches the paired leg at once, it does not wait out a timeout."""
    pair = Pair(tiny_llama_dir, LoopbackFaults(fail_after_bytes=1))
    prompt = list(range(400, 480))
    try:

        async def main() -> None:
            transfer = await pair.manager.reserve("broken", prompt, GREEDY, lease_s=60)
            pair.first_token("broken", prompt)
            handle = pair.push("broken", transfer)
            assert (await handle.wait_async(5)).value == "failed"
            pair.prefill.release_kv("broken")
            await pair.manager.reap()
            assert transfer.state is TransferState.FREED
            assert transfer.abort_cause is AbortCause.PUSH_FAILED
            assert "the push ended failed" in transfer.abort_reason
            assert await pair.decode_blocks_used() == 0

        asyncio.run(main())
    finally:
        pair.close()


class GatedCommit:
    """Wraps an AsyncEngine whose ``commit`` waits for ``gate``: holds a transfer COMMITTING."""

    def __init__(self, inner) -> None:
        self.inner, self.gate = inner, asyncio.Event()

    async def commit(self, *args, **kwargs):
        await self.gate.wait()
        return await self.inner.commit(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_caller_abort_while_committing_ends_the_request_once_committed(
    tiny_llama_dir: Path,
) -> None:
    """No lease or failure aborts a COMMITTING transfer (every byte is in); the caller's abort
    is kept and carried out on the running request, which frees its blocks."""
    prompt = list(range(200, 250))
    clock = FakeClock()
    pair = Pair(tiny_llama_dir, clock=clock)
    pair.manager.engine = GatedCommit(pair.decode)

    async def main() -> None:
        transfer = await pair.manager.reserve("c", prompt, GREEDY, lease_s=0.3)
        first = pair.first_token("c", prompt)
        assert (await pair.push("c", transfer).wait_async(5)).value == "done"
        pair.prefill.release_kv("c")
        stream = await pair.decode.attach("c")
        commit = asyncio.ensure_future(pair.manager.commit(transfer.transfer_id, first))
        while transfer.state is not TransferState.COMMITTING:
            await asyncio.sleep(0.01)
        clock.now += 1
        await pair.manager.reap()  # the lease has passed: a committing transfer is left alone
        assert transfer.state is TransferState.COMMITTING
        assert await pair.manager.abort_request("c", "stream closed", AbortCause.CALLER)
        pair.manager.engine.gate.set()
        await commit
        assert transfer.state is TransferState.COMMITTED and transfer.is_abandoned
        outputs = [out async for out in stream]
        assert outputs[-1].finish_reason is FinishReason.ABORT
        assert await pair.decode_blocks_used() == 0

    try:
        asyncio.run(main())
    finally:
        pair.close()


def test_a_commit_that_waited_while_the_transfer_was_aborted_is_refused(pair: Pair) -> None:
    async def main() -> None:
        transfer = await pair.manager.reserve("w", [5, 6, 7], GREEDY, lease_s=10)
        commit = asyncio.ensure_future(pair.manager.commit(transfer.transfer_id, 11))
        await asyncio.sleep(0.1)  # inside its wait for the pages (none will come)
        await pair.manager.abort(transfer.transfer_id, "stream closed", AbortCause.CALLER)
        with pytest.raises(CommitRefused, match="is freed"):
            await commit
        assert transfer.abort_cause is AbortCause.CALLER
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())


def test_a_commit_whose_caller_goes_away_is_still_handed_over(pair: Pair) -> None:
    """The prefill node's CommitKv cancelled mid-commit leaves no transfer half handed over."""
    prompt = list(range(200, 250))
    pair.manager.engine = GatedCommit(pair.decode)

    async def main() -> None:
        transfer = await pair.manager.reserve("h", prompt, GREEDY, lease_s=10)
        first = pair.first_token("h", prompt)
        assert (await pair.push("h", transfer).wait_async(5)).value == "done"
        pair.prefill.release_kv("h")
        stream = await pair.decode.attach("h")
        commit = asyncio.ensure_future(pair.manager.commit(transfer.transfer_id, first))
        while transfer.state is not TransferState.COMMITTING:
            await asyncio.sleep(0.01)
        commit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await commit
        pair.manager.engine.gate.set()
        outputs = [out async for out in stream]
        assert outputs[-1].finish_reason is FinishReason.LENGTH
        assert transfer.state is TransferState.COMMITTED and not pair.manager.transfers
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())


class SlowFence:
    """Wraps a transport whose fence takes ``delay_s`` (a busy transport thread)."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def fence(self, transfer_id: str, timeout: float) -> bool:
        time.sleep(self.delay_s)
        return self.inner.fence(transfer_id, timeout)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def record_engine_aborts(
    pair: Pair, *, entered: asyncio.Event | None = None, delay_s: float = 0.0
) -> list[str]:
    """Wrap the decode engine's ``abort``: the returned list records each request id aborted;
    ``entered`` is set as an abort begins, and ``delay_s`` holds it open before it runs."""
    aborted: list[str] = []
    engine_abort = pair.decode.abort

    async def recording_abort(request_id: str) -> bool:
        aborted.append(request_id)
        if entered is not None:
            entered.set()
        await asyncio.sleep(delay_s)
        return await engine_abort(request_id)

    pair.decode.abort = recording_abort
    return aborted


def test_the_reaper_never_fences_a_transfer_whose_abort_is_fencing(pair: Pair) -> None:
    """An abort's fence is slow; the reaper runs meanwhile and sees the transfer ABORTED. It
    must not fence and free it a second time: the second free would abort the request id again,
    and a decode node that recomputes reuses that id for the recomputation."""
    pair.manager.transport = SlowFence(pair.receiver, delay_s=0.3)
    aborted = record_engine_aborts(pair)

    async def main() -> None:
        transfer = await pair.manager.reserve("slow", [5, 6, 7, 8], GREEDY, lease_s=10)
        abort = asyncio.create_task(
            pair.manager.abort(transfer.transfer_id, "test", AbortCause.LEASE_EXPIRED)
        )
        await asyncio.sleep(0.05)  # the abort is fencing
        assert transfer.state is TransferState.ABORTED
        await pair.manager.reap()  # must leave it alone (before the fix: KeyError, two aborts)
        await abort
        assert transfer.state is TransferState.FREED
        assert aborted == ["slow"]
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())


def test_the_reaper_never_frees_a_transfer_whose_abort_is_freeing(pair: Pair) -> None:
    """The fence is done and the abort is handing the blocks back to the engine (an engine call
    that waits for a step) when the reaper runs: it must not free the transfer a second time.
    CI caught this: the second engine abort ended the recomputation, and the reaper's second
    removal from the table raised KeyError."""
    in_engine_abort = asyncio.Event()
    aborted = record_engine_aborts(pair, entered=in_engine_abort, delay_s=0.2)

    async def main() -> None:
        transfer = await pair.manager.reserve("freeing", [5, 6, 7, 8], GREEDY, lease_s=10)
        abort = asyncio.create_task(
            pair.manager.abort(transfer.transfer_id, "test", AbortCause.LEASE_EXPIRED)
        )
        await in_engine_abort.wait()
        await pair.manager.reap()  # before the fix: a second fence, abort and KeyError
        await abort
        assert transfer.state is TransferState.FREED
        assert aborted == ["freeing"]
        assert pair.manager.transfers == {}
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())


def test_a_reserve_whose_caller_goes_away_leaves_no_blocks(pair: Pair) -> None:
    """The Generate stream is cancelled (client gone, deadline past) while its reservation waits
    behind a busy engine: the reservation still runs on the engine thread, and with no transfer
    recorded for it, no lease or reaper would ever free its blocks."""
    gate = threading.Event()

    async def main() -> None:
        busy = asyncio.ensure_future(pair.decode.call(lambda e: gate.wait(5)))
        reserve = asyncio.ensure_future(
            pair.manager.reserve("gone", [5, 6, 7, 8], GREEDY, lease_s=10)
        )
        await asyncio.sleep(0)  # the reservation is queued behind the busy command
        reserve.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reserve
        gate.set()
        await busy
        assert pair.manager.transfers == {}
        assert await pair.decode_blocks_used() == 0
        assert not await pair.decode.call(lambda e: e.has_unfinished_requests)

    asyncio.run(main())


class GatedFence:
    """Wraps a transport whose fence waits for ``release`` (writes still draining)."""

    def __init__(self, inner) -> None:
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def fence(self, transfer_id: str, timeout: float) -> bool:
        self.entered.set()
        self.release.wait(5)
        return self.inner.fence(transfer_id, timeout)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_an_abort_rpc_during_a_failures_fence_waits_for_it_and_is_not_recomputed(
    pair: Pair,
) -> None:
    """The lease expired and its fence is running when the caller's Abort comes. The transfer
    is ABORTED, not open: the Abort must neither free the blocks through the engine before the
    fence proves the transport quiet, nor leave the stream to recompute the prompt (the id the
    fence's own engine abort would then end)."""
    fence = GatedFence(pair.receiver)
    pair.manager.transport = fence
    servicer = DecodeServicer(None, pair.decode, None, pair.manager, None)

    async def main() -> None:
        transfer = await pair.manager.reserve("late", [5, 6, 7, 8], GREEDY, lease_s=10)
        stream = await pair.decode.attach("late")
        expire = asyncio.create_task(
            pair.manager.abort(transfer.transfer_id, "lease expired", AbortCause.LEASE_EXPIRED)
        )
        await asyncio.to_thread(fence.entered.wait, 5)
        response = await servicer.Abort(decode_pb2.AbortRequest(request_id="late"), None)
        assert response.found
        assert await pair.decode_blocks_used() > 0  # still fencing: nothing freed yet
        fence.release.set()
        await expire
        outputs = [out async for out in stream]
        assert outputs[-1].finish_reason is FinishReason.ABORT
        assert transfer.state is TransferState.FREED
        assert transfer.abort_cause is AbortCause.CALLER  # the servicer will not recompute
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())


def test_a_caller_abort_while_a_refused_commit_runs_is_not_recomputed(pair: Pair) -> None:
    """The Abort RPC comes while the engine is taking the commit (kept for after it); the engine
    then refuses the commit. The abort that follows is the caller's: the stream, still open,
    must end rather than recompute the prompt the caller gave up on."""
    prompt = list(range(200, 250))
    pair.manager.engine = GatedCommit(pair.decode)

    async def main() -> None:
        transfer = await pair.manager.reserve("refused", prompt, GREEDY, lease_s=10)
        pair.first_token("refused", prompt)
        assert (await pair.push("refused", transfer).wait_async(5)).value == "done"
        pair.prefill.release_kv("refused")
        commit = asyncio.ensure_future(pair.manager.commit(transfer.transfer_id, 10**6))
        while transfer.state is not TransferState.COMMITTING:
            await asyncio.sleep(0.01)
        assert await pair.manager.abort_request("refused", "Abort", AbortCause.CALLER)
        pair.manager.engine.gate.set()
        with pytest.raises(CommitRefused, match="outside the vocabulary"):
            await commit
        assert transfer.state is TransferState.FREED
        assert transfer.abort_cause is AbortCause.CALLER  # the servicer will not recompute
        assert await pair.decode_blocks_used() == 0

    asyncio.run(main())
