"""Decode side of the KV handoff: one state machine per transfer, held where the memory is.

Life cycle of a transfer (design §3):

    RESERVED ──(first inbound byte)──▶ RECEIVING ──commit──▶ COMMITTING ──▶ COMMITTED
        └──────────────┴──abort / lease expiry / bad commit──▶ ABORTED ──fence ok──▶ FREED

- ``reserve`` takes blocks from the engine for the prompt and gives the transfer a fresh id
  (a retry is always a new transfer, never a reused id) and a liveness lease. There is no room
  while ``max_unstarted`` reservations have not seen their prefill start, or while the engine
  has too few blocks or seats. Without room it refuses (None: the gateway tries another node);
  asked to ``wait`` (the gateway found every node full), it waits, FIFO and holding no blocks,
  unless ``max_waiting`` already wait (then None: the gateway answers 429).
- ``renew`` (the prefill node's RenewKv) moves the lease deadline to now + the lease: the
  prefill node renews from the moment it holds the request until its commit, so the lease
  measures whether it is alive, not how long its queue is (design §3a). ``started`` marks the
  first renew after its engine began the prompt: from then the reservation no longer counts
  against ``max_unstarted`` nor in ``unstarted_blocks``.
- ``commit`` is accepted only from RESERVED/RECEIVING, and only when the transport itself
  reports every byte of the transfer DONE: completion is confirmed by a message, never counted.
  The request then joins the running batch; its blocks are the request's from here on (the
  engine frees them when it ends). COMMITTING is the one engine call in between: no lease or
  failure can abort it (every byte is in), and a caller's abort there is kept and carried out
  on the running request as soon as the engine has it.
- ``abort`` (the caller went away, the lease expired, the push failed, the commit was bad)
  moves to ABORTED and frees the blocks only after ``fence`` proves that no byte of the transfer
  can still land (memory a peer may still write is never freed or reused). A fence that times
  out leaves the blocks quarantined; the reaper retries it. Each abort records its
  ``AbortCause``: the servicer recomputes the prompt itself after a failure
  (``on_kv_failure=recompute``), never after the caller's own abort — even one that comes
  while a failure's fence runs: it takes over the cause.
- The reaper runs every ``reap_interval_s``: it aborts leases past their deadline and transfers
  whose writer ended them (failed, cancelled or timed out: no commit can follow, so waiting for
  the lease would only delay the caller), and retries quarantined fences. Every wait is
  bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kv_transfer import KvTransport, TransferStatus
from services.async_engine import AsyncEngine
from services.engine import Reservation, SamplingParams
from services.node.metrics import NodeMetrics
from services.types import StageTimings

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    COMMITTING = "committing"
    COMMITTED = "committed"
    ABORTED = "aborted"
    FREED = "freed"


_OPEN = (TransferState.RESERVED, TransferState.RECEIVING)


class AbortCause(enum.Enum):
    """Why a transfer was aborted before its commit; the value is the metric label."""

    CALLER = "caller"  # the Generate stream closed, or the Abort RPC
    LEASE_EXPIRED = "lease_expired"  # no commit by the lease deadline (the prefill node died?)
    PUSH_FAILED = "push_failed"  # the writer ended the transfer other than DONE
    BAD_COMMIT = "bad_commit"  # committed before every page landed, or refused by the engine

    @property
    def is_failure(self) -> bool:
        """A failure of the KV handoff (recomputable), not the caller's own decision."""
        return self is not AbortCause.CALLER


class CommitRefused(Exception):
    """A commit that cannot be honoured; ``reason`` says why (the servicer returns
    FAILED_PRECONDITION). The transfer is aborted when the refusal leaves it unusable."""


@dataclass
class Transfer:
    transfer_id: str
    request_id: str
    block_ids: list[int]
    lease_deadline: float
    """time.monotonic() after which an uncommitted reservation is aborted (moved by renew)."""
    lease_s: float = 0.0
    """The liveness lease each renew grants."""
    started_at: float | None = None
    """time.monotonic() of the renew that said the prefill node's engine began the prompt."""
    state: TransferState = TransferState.RESERVED
    abort_reason: str = ""
    abort_cause: AbortCause | None = None
    num_cached_blocks: int = 0
    """The first blocks of ``block_ids`` came from this node's prefix cache (they hold the
    prompt's KV already): the prefill node pushes the rest only."""
    cached_prompt_tokens: int = 0
    """From the commit: prompt tokens the prefill node served from its prefix cache."""
    prefill_timings: StageTimings | None = None
    """From the commit: the prefill node's stages (queue, compute, transfer)."""
    is_fencing: bool = False
    """An abort's fence is running (the reaper must not start another)."""
    committed_at: float | None = None
    """time.monotonic() when the commit was accepted (the decode queue starts here)."""
    is_abandoned: bool = False
    """The caller went away while COMMITTING: abort the request once the engine runs it."""


@dataclass
class TransferCounters:
    reserved: int = 0
    committed: int = 0
    aborted: int = 0
    expired: int = 0
    fence_retries: int = 0
    renewed: int = 0
    waited: int = 0
    """Reservations that waited for room before they were granted."""


class RenewRefused(Exception):
    """A renew of a transfer that is no longer open (the servicer returns FAILED_PRECONDITION):
    the prefill node should stop working on it."""


class TransferManager:
    def __init__(
        self,
        engine: AsyncEngine,
        transport: KvTransport,
        *,
        fence_timeout_s: float = 1.0,
        reap_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        metrics: NodeMetrics | None = None,
        max_unstarted: int = 16,
        max_waiting: int = 1024,
        room_poll_s: float = 0.05,
    ) -> None:
        """``room_poll_s``: how often a waiting reservation looks for room again (the engine
        frees blocks as requests end, which this class is not told about)."""
        if max_unstarted < 1 or max_waiting < 0:
            raise ValueError(
                f"max_unstarted must be >= 1 and max_waiting >= 0, got {max_unstarted} and "
                f"{max_waiting}"
            )
        self.max_unstarted = max_unstarted
        self.max_waiting = max_waiting
        self.room_poll_s = room_poll_s
        self.num_waiting = 0
        self._queue = asyncio.Lock()  # FIFO: the head of the wait takes the next room
        self._room = asyncio.Event()  # set when a reservation starts or is freed
        self.engine = engine
        self.metrics = metrics
        self.transport = transport
        self.fence_timeout_s = fence_timeout_s
        self.reap_interval_s = reap_interval_s
        self.clock = clock
        self.transfers: dict[str, Transfer] = {}
        """Transfers not yet FREED (live, committed-but-tracked are dropped at commit)."""
        self.counters = TransferCounters()
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reaper = asyncio.ensure_future(self._reap_forever())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)

    @property
    def num_quarantined(self) -> int:
        return sum(1 for t in self.transfers.values() if t.state is TransferState.ABORTED)

    def _unstarted(self) -> list[Transfer]:
        return [t for t in self.transfers.values() if t.state in _OPEN and t.started_at is None]

    @property
    def unstarted_blocks(self) -> int:
        """Blocks held by open reservations whose prefill has not started."""
        return sum(len(t.block_ids) for t in self._unstarted())

    def _publish_gauges(self) -> None:
        if self.metrics is not None:
            unstarted = self._unstarted()
            self.metrics.kv_unstarted_reservations.set(len(unstarted))
            self.metrics.kv_unstarted_blocks.set(sum(len(t.block_ids) for t in unstarted))
            self.metrics.kv_waiting_reservations.set(self.num_waiting)

    def _room_changed(self) -> None:
        self._room.set()
        self._publish_gauges()

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        lease_s: float,
        wait: bool = False,
    ) -> Transfer | None:
        """Blocks for the prompt, or None (RESOURCE_EXHAUSTED): without ``wait``, when there
        is no room now (or others wait for it); with it, when ``max_waiting`` already wait.
        Input errors raise ``ValueError`` naming the field (INVALID_ARGUMENT). The caller's
        deadline bounds a wait (the cancellation leaves nothing behind)."""
        if not wait:
            if self.num_waiting or len(self._unstarted()) >= self.max_unstarted:
                return None
            # AsyncEngine.reserve: a caller cancelled before the transfer is recorded (no lease,
            # no reaper would ever see it) leaves no blocks behind.
            reservation = await self.engine.reserve(request_id, prompt_token_ids, params)
            if reservation is None:
                return None
        else:
            if self.num_waiting >= self.max_waiting:
                return None
            self.num_waiting += 1
            self._publish_gauges()
            try:
                async with self._queue:
                    reservation = await self._reserve_when_room(
                        request_id, prompt_token_ids, params
                    )
            finally:
                self.num_waiting -= 1
                self._publish_gauges()
        transfer = Transfer(
            transfer_id=f"kv-{uuid.uuid4().hex}",
            request_id=request_id,
            block_ids=reservation.block_ids,
            num_cached_blocks=reservation.num_cached_blocks,
            lease_deadline=self.clock() + lease_s,
            lease_s=lease_s,
        )
        self.transfers[transfer.transfer_id] = transfer
        self.counters.reserved += 1
        self._publish_gauges()
        return transfer

    async def _reserve_when_room(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Reservation:
        waited = False
        while True:
            self._room.clear()
            if len(self._unstarted()) < self.max_unstarted:
                reservation = await self.engine.reserve(request_id, prompt_token_ids, params)
                if reservation is not None:
                    self.counters.waited += waited
                    return reservation
            waited = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), self.room_poll_s)

    def renew(self, transfer_id: str, *, started: bool) -> Transfer:
        """The prefill node is alive and holds the request: the lease starts again."""
        transfer = self.transfers.get(transfer_id)
        if transfer is None:
            raise RenewRefused(f"transfer_id {transfer_id!r} is unknown or already ended")
        if transfer.state is TransferState.COMMITTING:
            return transfer  # every byte is in; no lease applies any more
        if transfer.state not in _OPEN:
            raise RenewRefused(f"transfer {transfer_id} is {transfer.state.value}")
        now = self.clock()
        transfer.lease_deadline = now + transfer.lease_s
        self.counters.renewed += 1
        if started and transfer.started_at is None:
            transfer.started_at = now
            self._room_changed()
        return transfer

    async def commit(
        self,
        transfer_id: str,
        first_token_id: int,
        logprobs: dict[int, float] | None = None,
        *,
        cached_prompt_tokens: int = 0,
        prefill_timings: StageTimings | None = None,
    ) -> Transfer:
        transfer = self.transfers.get(transfer_id)
        if transfer is None:
            raise CommitRefused(f"transfer_id {transfer_id!r} is unknown or already freed")
        if transfer.state not in _OPEN:
            raise CommitRefused(f"transfer {transfer_id} is {transfer.state.value}")
        # Not a host-speed guess: the prefill node commits only after its push ended DONE, and
        # every transport reports that only once this side saw the last page land (the UCX
        # receiver's ACK, the shm table, loopback's own copy). So the pages are here already;
        # the short wait only gives a commit sent without its push a bounded refusal.
        status = await asyncio.to_thread(self.transport.wait_inbound, transfer_id, 0.5)
        if transfer.state not in _OPEN:  # aborted (or committed by a duplicate) meanwhile
            raise CommitRefused(f"transfer {transfer_id} is {transfer.state.value}")
        if status is not TransferStatus.DONE:
            seen = status.value if status is not None else "no bytes seen"
            await self.abort(
                transfer_id, f"committed before its pages landed ({seen})", AbortCause.BAD_COMMIT
            )
            raise CommitRefused(f"transfer {transfer_id}: pages not all received ({seen})")
        # Recorded before the engine commit: the request may finish in it (EOS, max_tokens=1),
        # and its stream reads these as it ends.
        transfer.cached_prompt_tokens = cached_prompt_tokens
        transfer.prefill_timings = prefill_timings
        transfer.committed_at = time.monotonic()
        previous, transfer.state = transfer.state, TransferState.COMMITTING
        # Shielded: a caller that goes away now (the prefill node's CommitKv cancelled) must not
        # leave the transfer half handed over; the engine call runs either way.
        return await asyncio.shield(self._hand_over(transfer, previous, first_token_id, logprobs))

    async def _hand_over(
        self,
        transfer: Transfer,
        previous: TransferState,
        first_token_id: int,
        logprobs: dict[int, float] | None,
    ) -> Transfer:
        """COMMITTING → COMMITTED: the engine takes the request into its running batch."""
        transfer_id = transfer.transfer_id
        try:
            await self.engine.commit(transfer.request_id, first_token_id, logprobs)
        except (KeyError, ValueError) as exc:
            transfer.state = previous
            # A caller's abort kept while the engine call ran is still the caller's: the stream
            # (open if it came by the Abort RPC) must end, not recompute.
            cause = AbortCause.CALLER if transfer.is_abandoned else AbortCause.BAD_COMMIT
            await self.abort(transfer_id, f"commit rejected by the engine: {exc}", cause)
            raise CommitRefused(str(exc)) from None
        transfer.state = TransferState.COMMITTED
        # From here the blocks belong to the running request; the engine frees them at its end.
        # The transport's record goes too (a late duplicate of this id is refused either way).
        del self.transfers[transfer_id]
        self.transport.forget_inbound(transfer_id)
        self.counters.committed += 1
        self._room_changed()
        if transfer.is_abandoned:
            # Every byte landed, so nothing needs fencing: a plain abort frees the blocks.
            await self.engine.abort(transfer.request_id)
        return transfer

    async def abort(self, transfer_id: str, reason: str, cause: AbortCause) -> None:
        """End an uncommitted transfer; its blocks are freed once the transport is quiet."""
        transfer = self.transfers.get(transfer_id)
        if transfer is not None and transfer.state is TransferState.COMMITTING:
            if cause is AbortCause.CALLER:
                transfer.is_abandoned = True
            return
        if transfer is None or transfer.state not in _OPEN:
            return
        logger.info(
            "aborting KV transfer %s of %s (%s): %s",
            transfer_id,
            transfer.request_id,
            cause.value,
            reason,
        )
        transfer.state = TransferState.ABORTED
        transfer.abort_reason = reason
        transfer.abort_cause = cause
        self.counters.aborted += 1
        self._room_changed()  # no longer unstarted (its blocks come back after the fence)
        if self.metrics is not None:
            self.metrics.transfer_failed(cause.value)
        await self._fence_and_free(transfer)

    async def abort_request(self, request_id: str, reason: str, cause: AbortCause) -> bool:
        """Abort the request's transfer, if it still holds its blocks (True); they are freed
        after the fence, like any abort."""
        # ABORTED ones too (a failure's fence running, or quarantined): their blocks are freed by
        # the fence, never by the engine abort the servicer falls back to when this is False.
        transfers = [t for t in self.transfers.values() if t.request_id == request_id]
        for transfer in transfers:
            if transfer.state is TransferState.ABORTED and cause is AbortCause.CALLER:
                # The caller's abort wins over the failure: its stream must not recompute.
                transfer.abort_cause, transfer.abort_reason = cause, reason
            await self.abort(transfer.transfer_id, reason, cause)
        return bool(transfers)

    async def reap(self) -> None:
        """Abort expired leases and transfers their writer ended; retry quarantined fences."""
        now = self.clock()
        for transfer in list(self.transfers.values()):
            if transfer.state is TransferState.ABORTED:
                self.counters.fence_retries += 1
                await self._fence_and_free(transfer)
            elif transfer.state in _OPEN:
                status = self.transport.inbound_status(transfer.transfer_id)
                if status is not None:
                    transfer.state = TransferState.RECEIVING
                if status is not None and status.is_terminal and status is not TransferStatus.DONE:
                    error = self.transport.inbound.error(transfer.transfer_id)
                    await self.abort(
                        transfer.transfer_id,
                        f"the push ended {status.value} ({error})",
                        AbortCause.PUSH_FAILED,
                    )
                elif now >= transfer.lease_deadline:
                    self.counters.expired += 1
                    await self.abort(
                        transfer.transfer_id,
                        "lease expired without a commit",
                        AbortCause.LEASE_EXPIRED,
                    )

    async def _fence_and_free(self, transfer: Transfer) -> None:
        # One fence and one free per transfer: the reaper retries quarantined transfers, and must
        # not fence or free one whose abort is still doing so — the second free would abort the
        # request again, and by then the id may name its recomputation.
        if transfer.is_fencing:
            return
        transfer.is_fencing = True
        try:
            quiet = await asyncio.to_thread(
                self.transport.fence, transfer.transfer_id, self.fence_timeout_s
            )
        finally:
            transfer.is_fencing = False
        if not quiet:
            logger.warning(
                "transfer %s still has writes in flight: its %d blocks stay quarantined",
                transfer.transfer_id,
                len(transfer.block_ids),
            )
            return
        # FREED and forgotten before the engine call: while it runs the reaper must not see an
        # ABORTED transfer with no fence running and free it again.
        transfer.state = TransferState.FREED
        del self.transfers[transfer.transfer_id]
        self.transport.forget_inbound(transfer.transfer_id)
        # AsyncEngine.abort: a stream already attached to the request ends with abort.
        await self.engine.abort(transfer.request_id)
        self._room_changed()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                await self.reap()
            except Exception:
                logger.exception("KV transfer reaper failed; retrying")
