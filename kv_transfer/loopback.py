"""The in-process transport: copies pages between transports of one process with numpy.

It serves the tests and the colocated node, and injects faults (delay, stall, failure after N
bytes) so the life-cycle tests can drive every terminal status without a network.

A transfer's life here: `write()` validates and plans (PENDING), queues it to the writer's copy
thread (IN_PROGRESS on pick-up), which copies message by message, checking cancel, deadline and
the receiver's fence between messages, then marks both sides DONE / FAILED / TIMED_OUT.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kv_transfer.page_copy import PageCopy
from kv_transfer.page_table import PageTable
from kv_transfer.peer_address import PeerAddress
from kv_transfer.transfer_handle import TransferHandle
from kv_transfer.transfer_plan import MAX_STAGED_BYTES, TransferPlan, gather, scatter
from kv_transfer.transfer_status import TransferStatus
from kv_transfer.transport import KvTransport, TransportInfo, register_transport

logger = logging.getLogger(__name__)

# Endpoint id → live loopback transport: how a writer finds its receiver in this process.
_ENDPOINTS: weakref.WeakValueDictionary[bytes, LoopbackTransport] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class LoopbackFaults:
    """Faults the writer injects into its transfers (tests only)."""

    # Sleep before each message.
    delay_per_message_s: float = 0.0
    # Never finish: wait for cancel, deadline or close.
    stall: bool = False
    # Fail the transfer once this many bytes were copied (None: never).
    fail_after_bytes: int | None = None
    # Pause this long before the last message (cancel, deadline and close still end it): the
    # receiver has seen the transfer begin and holds part of its bytes meanwhile.
    pause_before_last_s: float = 0.0


@dataclass
class _Job:
    handle: TransferHandle
    plan: TransferPlan
    receiver: LoopbackTransport


class LoopbackTransport(KvTransport):
    name = "loopback"

    def __init__(
        self, faults: LoopbackFaults | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.faults = faults or LoopbackFaults()
        # What deadlines and pauses are measured on (a test passes a fake clock it moves on).
        self._clock = clock
        self._endpoint = uuid.uuid4().bytes
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        # One staging buffer, reused (the copy thread runs one message at a time).
        self._staging = np.empty(MAX_STAGED_BYTES, dtype=np.uint8)
        self._active: set[TransferHandle] = set()
        self._lock = threading.Lock()
        self._is_closed = False
        self._thread = threading.Thread(target=self._run, name="kv-loopback", daemon=True)
        self._thread.start()
        _ENDPOINTS[self._endpoint] = self

    def address(self) -> PeerAddress:
        regions = self.region_lengths()
        return PeerAddress(self.name, self._endpoint, regions)

    def connect(self, peer: PeerAddress, timeout: float = 5.0) -> None:
        self._find(peer)

    def write(
        self,
        peer: PeerAddress,
        pages: Sequence[PageCopy] | PageTable,
        *,
        transfer_id: str,
        deadline: float,
    ) -> TransferHandle:
        plan = self._plan_write(peer, pages, is_closed=self._is_closed)
        handle = TransferHandle(transfer_id, plan.num_bytes, deadline)
        receiver = _ENDPOINTS.get(peer.endpoint)
        if receiver is None or receiver._is_closed:
            handle.finish(TransferStatus.FAILED, "the peer is closed or unknown")
            return handle
        with self._lock:
            self._active.add(handle)
        self._jobs.put(_Job(handle, plan, receiver))
        return handle

    def info(self) -> TransportInfo:
        return TransportInfo(self.name, ["memcpy"], f"numpy {np.__version__}")

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        _ENDPOINTS.pop(self._endpoint, None)
        with self._lock:
            active = list(self._active)
        for handle in active:
            handle.finish(TransferStatus.FAILED, "the writer's transport was closed")
        self._jobs.put(None)
        self._thread.join(timeout=5.0)

    def _find(self, peer: PeerAddress) -> LoopbackTransport:
        if peer.transport != self.name:
            raise ValueError(f"a {peer.transport} address cannot be reached over loopback")
        receiver = _ENDPOINTS.get(peer.endpoint)
        if receiver is None:
            raise ConnectionError("no live loopback transport has that address")
        return receiver

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._copy(job)
            except Exception as exc:  # a bug must fail the transfer, not kill the thread
                logger.exception("loopback transfer %s failed", job.handle.transfer_id)
                self._end(job, TransferStatus.FAILED, f"internal error: {exc!r}")
            finally:
                with self._lock:
                    self._active.discard(job.handle)

    def _copy(self, job: _Job) -> None:
        handle, plan, receiver = job.handle, job.plan, job.receiver
        tid = handle.transfer_id
        refusal = receiver.inbound.begin(tid)
        if refusal is not None:
            self._end(job, TransferStatus.FAILED, refusal, tell_receiver=False)
            return
        handle.start()
        src = [self._regions[n].host_view() for n in plan.src_regions]
        dst = [receiver._regions[n].host_view() for n in plan.dst_regions]
        faults = self.faults
        last = len(plan.messages) - 1
        for index, message in enumerate(plan.messages):
            if faults.delay_per_message_s:
                time.sleep(faults.delay_per_message_s)
            if index == last and faults.pause_before_last_s:
                resume_at = self._clock() + faults.pause_before_last_s
                while self._clock() < resume_at and not self._should_stop(job):
                    time.sleep(0.002)
            while faults.stall and not self._should_stop(job):
                time.sleep(0.002)
            if self._should_stop(job):
                return
            if (
                faults.fail_after_bytes is not None
                and handle.bytes_moved + message.num_bytes > faults.fail_after_bytes
            ):
                self._end(job, TransferStatus.FAILED, "injected failure")
                return
            runs = plan.runs[message.run_start : message.run_end]
            if message.is_staged:
                staging = self._staging[: message.num_bytes]
                gather(runs, src, staging)
            if not receiver.inbound.begin_write(tid):
                self._end(job, TransferStatus.FAILED, "fenced by the receiver")
                return
            try:
                if message.is_staged:
                    scatter(runs, staging, dst)
                else:
                    s_region, s_off, d_region, d_off, length = runs[0].tolist()
                    dst[d_region][d_off : d_off + length] = src[s_region][s_off : s_off + length]
            finally:
                receiver.inbound.end_write(tid, message.num_bytes)
            handle.add_bytes(message.num_bytes)
        self._end(job, TransferStatus.DONE)

    def _should_stop(self, job: _Job) -> bool:
        """Ends the job if it was cancelled, timed out, or an end closed; True if it ended."""
        handle = job.handle
        if handle.status.is_terminal:
            job.receiver.inbound.finish(
                handle.transfer_id, handle.status, handle.error or "aborted by the writer"
            )
            return True
        if job.receiver._is_closed or self._is_closed:
            self._end(job, TransferStatus.FAILED, "the peer was closed")
            return True
        if self._clock() > handle.deadline:
            self._end(job, TransferStatus.TIMED_OUT, "the deadline passed")
            return True
        return False

    def _end(
        self,
        job: _Job,
        status: TransferStatus,
        error: str | None = None,
        tell_receiver: bool = True,
    ) -> None:
        if tell_receiver:
            job.receiver.inbound.finish(job.handle.transfer_id, status, error)
        job.handle.finish(status, error)


register_transport(LoopbackTransport.name, LoopbackTransport)
