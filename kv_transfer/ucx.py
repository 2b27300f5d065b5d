"""The UCX transport (ucxx): pages between processes and hosts over shared memory, TCP or RDMA.

A one-sided `write()` is carried by tagged messages that the receiver matches itself. That gives
the receiver a strong fence for free: it posts a receive into its blocks only for a message that
has already arrived (probe, then receive with the probe's handle), and only while the transfer is
allowed to write; anything else is drained into scratch memory. No receive into KV blocks is ever
left posted. Every DATA message moves its pages in place on both sides, zero-copy: a contiguous
span as a plain buffer (ucxx), scattered pages as a scatter-gather list (`ucp_native`: libucp's
IOV datatype, which ucxx does not expose), so UCX copies each page from its source block straight
into its destination block.

A transfer's life on the writer: write() plans it (PENDING); the agent thread sends a HEADER and
the DATA messages (IN_PROGRESS); the receiver's ACK ends it DONE or FAILED; cancel() or the
deadline end it CANCELLED / TIMED_OUT and send an ABORT; a BYE from the peer ends it FAILED.
On the receiver: HEADER → IN_PROGRESS; all DATA landed → DONE (+ ACK); ABORT → CANCELLED;
writer's BYE → FAILED; no progress by the writer's deadline → TIMED_OUT; fence() → CANCELLED.

Threads: one agent thread per transport makes every UCX call and progresses the worker itself:
it spins while requests are in flight and sleeps in epoll (1 ms at most) when idle. (ucxx's own
progress thread in blocking mode never wakes for a receive posted from another thread on an
already-arrived rendezvous message, and in polling mode it burns a core.) Callers only plan,
enqueue and wait; a new write waits at most the 1 ms epoll timeout to start.

Peer failure: with `error_handling=False` (the default) UCX may use shared memory and CMA between
processes of a host (measured ~10 GB/s here, vs ~0.8 GB/s over TCP loopback), but it cannot
report a killed peer: such a transfer ends TIMED_OUT by its deadline. A peer that closes says
BYE, so its transfers end FAILED at once. `error_handling=True` reports killed peers as FAILED but
restricts UCX to transports with peer-failure detection (TCP, RDMA).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import re
import secrets
import select
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from kv_transfer.page_copy import PageCopy
from kv_transfer.page_table import PageTable
from kv_transfer.peer_address import PeerAddress
from kv_transfer.transfer_handle import TransferHandle
from kv_transfer.transfer_plan import (
    DST,
    DST_OFF,
    LEN,
    SRC,
    SRC_OFF,
    TransferPlan,
    contiguous_span,
)
from kv_transfer.transfer_status import TransferStatus
from kv_transfer.transport import KvTransport, TransportInfo, register_transport
from kv_transfer.ucx_wire import MAX_MESSAGES, MAX_SEQ, Header, Kind, make_tag, split_tag

# ucxx sets UCX defaults for GPU hosts when imported; these must be set before that import.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# ucxx defaults rendezvous staging to device memory; host memory is what this transport moves.
os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")

import ucxx  # noqa: E402
from ucxx._lib import libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

from kv_transfer import ucp_native  # noqa: E402  (after ucxx: it uses the libucp ucxx loaded)
from kv_transfer.ucp_native import ProbedMessage  # noqa: E402

logger = logging.getLogger(__name__)

_ID_BYTES = 16
_STATUS_CODES = list(TransferStatus)
# Agent: the longest sleep in epoll (ms) with transfers waiting on a peer (so deadlines are seen
# on time), and with none; messages and commands (wake pipe) wake it at once.
_WAITING_EPOLL_MS = 10
_IDLE_EPOLL_MS = 100
# Receiver grace past the writer's deadline before it declares a transfer TIMED_OUT.
_RECEIVER_GRACE_S = 1.0
# Sends still pending this long after their transfer ended are abandoned (a dead peer).
_ABANDON_AFTER_S = 10.0
# Shared-memory transports cannot detect a failed peer, so error handling disables them.
_SHM_TRANSPORTS = ("posix", "sysv", "cma", "xpmem", "knem")


@dataclass
class _Outbound:
    handle: TransferHandle
    plan: TransferPlan
    peer_id: bytes
    seq: int
    # (request, bytes it carries, buffer or IOV table it reads) for sends not yet complete.
    pending: list[tuple[object, int, np.ndarray]] = field(default_factory=list)
    is_abort_sent: bool = False
    # The endpoint the messages go through, and the next DATA message to send (all are sent at
    # once, unless ``pause_before_last_s`` holds the last one back until ``resume_at``).
    ep: object = None
    next_message: int = 0
    resume_at: float | None = None


@dataclass
class _Inbound:
    header: Header
    deadline: float
    dst_views: list[np.ndarray]
    # Address of each destination region's first byte: int64 [num_dst_regions].
    dst_bases: np.ndarray
    num_remaining: int
    # (request, message index) of receives into the destination blocks not yet complete.
    pending: list[tuple[object, int]] = field(default_factory=list)
    is_dropped: bool = False


class UcxTransport(KvTransport):
    name = "ucx"

    def __init__(self, error_handling: bool = False, pause_before_last_s: float = 0.0) -> None:
        """``pause_before_last_s`` is fault injection for tests: each write holds its last DATA
        message back this long (the agent keeps running), so a test can kill or cancel a writer
        while the receiver holds part of a transfer."""
        super().__init__()
        self.error_handling = error_handling
        self.pause_before_last_s = pause_before_last_s
        self._context = ucx_api.UCXContext(
            feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
        )
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        # A pipe in the worker's epoll set lets callers wake the agent from its epoll sleep.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._epoll = select.epoll.fromfd(os.dup(self._worker.epoll_file_descriptor))
        self._epoll.register(self._wake_r, select.EPOLLIN)
        # Peer id → set once the peer answered our HELLO (it can then tell us when it closes).
        self._welcomed: dict[bytes, threading.Event] = {}
        self._worker_address = bytes(self._worker.address.tobytes())
        self._id = uuid.uuid4().bytes
        self._slot = secrets.randbelow(1 << 24)
        # next() on a count is atomic: concurrent write() calls get distinct sequence numbers.
        self._seqs = itertools.count()
        # Every handle not yet ended, so that close() can end those still queued.
        self._handles: weakref.WeakSet[TransferHandle] = weakref.WeakSet()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        # Agent-thread state (touched only by the agent).
        self._endpoints: dict[bytes, object] = {}  # peer id → endpoint we write through
        self._reply_endpoints: dict[bytes, object] = {}  # writer id → endpoint for ACK / BYE
        self._slot_owners: dict[int, bytes] = {}
        self._closed_peers: set[bytes] = set()
        self._outbound: dict[int, _Outbound] = {}
        self._inbound: dict[tuple[int, int], _Inbound] = {}
        # (request, buffer it reads or writes) of control sends and drained messages.
        self._drains: list[tuple[object, np.ndarray]] = []
        self._abandoned: list[tuple[float, _Outbound]] = []
        self._is_closed = False
        self._stop = threading.Event()
        self._agent = threading.Thread(target=self._run, name="kv-ucx-agent", daemon=True)
        self._agent.start()

    # Public API (any thread).

    def address(self) -> PeerAddress:
        regions = self.region_lengths()
        return PeerAddress(self.name, self._id + self._worker_address, regions)

    def connect(self, peer: PeerAddress, timeout: float = 5.0) -> None:
        if peer.transport != self.name:
            raise ValueError(f"a {peer.transport} address cannot be reached over ucx")
        peer_id = peer.endpoint[:_ID_BYTES]
        welcomed = self._welcomed.setdefault(peer_id, threading.Event())
        try:
            self._call(lambda: self._endpoint(peer.endpoint)).result(timeout)
        except Exception as exc:
            raise ConnectionError(f"cannot reach the ucx peer: {exc}") from exc
        if not welcomed.wait(timeout):
            raise ConnectionError(f"the ucx peer did not answer within {timeout} s")

    def write(
        self,
        peer: PeerAddress,
        pages: Sequence[PageCopy] | PageTable,
        *,
        transfer_id: str,
        deadline: float,
    ) -> TransferHandle:
        plan = self._plan_write(peer, pages, is_closed=self._is_closed)
        if len(plan.messages) > MAX_MESSAGES:
            raise ValueError(f"{len(plan.messages)} messages in one transfer; max {MAX_MESSAGES}")
        seq = next(self._seqs) % MAX_SEQ
        # cancel() needs no callback: the agent sees the terminal status and sends the ABORT.
        handle = TransferHandle(transfer_id, plan.num_bytes, deadline)
        record = _Outbound(handle, plan, peer.endpoint[:_ID_BYTES], seq)
        self._handles.add(handle)
        self._post(lambda: self._start_write(record, peer.endpoint))
        return handle

    def info(self) -> TransportInfo:
        lanes = re.findall(r"resource\s+\d+\s*:.*?--\s*(\S+)", self._context.info)
        if self.error_handling:
            lanes = [lane for lane in lanes if not lane.startswith(_SHM_TRANSPORTS)]
        major, minor, release = ucx_api.get_ucx_version()
        return TransportInfo(
            self.name, lanes, f"ucx {major}.{minor}.{release} / ucxx {ucxx.__version__}"
        )

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        done = self._call(self._say_bye)
        try:
            done.result(timeout=2.0)
        except Exception:
            logger.warning("ucx transport: could not say BYE to every peer", exc_info=True)
        self._stop.set()
        self._post(lambda: None)
        self._agent.join(timeout=5.0)
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        for handle in list(self._handles):
            handle.finish(TransferStatus.FAILED, "the writer's transport was closed")

    # Agent thread.

    def _call(self, fn: Callable[[], object]) -> Future[object]:
        future: Future[object] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        self._post(run)
        return future

    def _post(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        # A full pipe means the agent is awake already.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                is_busy = self._step()
            except Exception:
                logger.exception("ucx transport agent step failed")
                is_busy = False
            if is_busy or self._has_local_work():
                self._worker.progress()
                time.sleep(0)  # let the caller's threads have the GIL
            else:
                waiting = self._outbound or self._inbound
                self._worker.progress_worker_event(_WAITING_EPOLL_MS if waiting else _IDLE_EPOLL_MS)

    def _has_local_work(self) -> bool:
        """True while a request of ours is in flight (progress must not wait for an event)."""
        return bool(
            self._drains
            or any(r.pending for r in self._inbound.values())
            or any(r.pending for r in self._outbound.values())
        )

    def _step(self) -> bool:
        is_busy = False
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            command()
            is_busy = True
        for _ in range(256):
            probe = ucp_native.probe(self._worker.handle)
            if probe is None:
                break
            self._on_message(probe)
            is_busy = True
        is_busy |= self._poll_outbound()
        is_busy |= self._poll_inbound()
        is_busy |= self._poll_drains()
        return is_busy

    def _endpoint(self, endpoint: bytes) -> object:
        peer_id = endpoint[:_ID_BYTES]
        ep = self._endpoints.get(peer_id)
        if ep is None:
            address = ucx_api.UCXAddress.create_from_buffer(endpoint[_ID_BYTES:])
            ep = ucx_api.UCXEndpoint.create_from_worker_address(
                self._worker, address, self.error_handling
            )
            self._endpoints[peer_id] = ep
            hello = np.frombuffer(self._id + self._worker_address, dtype=np.uint8)
            self._send_small(ep, make_tag(Kind.HELLO, self._slot, 0), hello)
        return ep

    def _reply_endpoint(self, writer_id: bytes, address: bytes) -> object:
        ep = self._reply_endpoints.get(writer_id)
        if ep is None:
            ep = ucx_api.UCXEndpoint.create_from_worker_address(
                self._worker, ucx_api.UCXAddress.create_from_buffer(address), self.error_handling
            )
            self._reply_endpoints[writer_id] = ep
        return ep

    def _send_small(self, ep: object, tag: int, body: np.ndarray) -> None:
        """Fire-and-forget control message; the buffer is kept until the send completes."""
        request = ep.tag_send(Array(body), ucx_api.UCXXTag(tag))  # type: ignore[attr-defined]
        self._drains.append((request, body))

    def _recv_now(self, probe: ProbedMessage) -> np.ndarray:
        """Receives a probed control message (already here) into a fresh buffer."""
        buffer = np.empty(max(probe.length, 1), dtype=np.uint8)
        request = ucp_native.receive(self._worker.handle, probe, buffer)
        limit = time.monotonic() + 5.0
        while not request.completed:
            if time.monotonic() > limit:
                raise TimeoutError("a control message did not complete in 5 s")
            self._worker.progress()
        request.check_error()
        return buffer[: probe.length]

    def _start_write(self, record: _Outbound, endpoint: bytes) -> None:
        handle, plan = record.handle, record.plan
        if handle.status.is_terminal:
            return
        if record.peer_id in self._closed_peers:
            handle.finish(TransferStatus.FAILED, "the peer closed")
            return
        try:
            ep = self._endpoint(endpoint)
        except Exception as exc:
            handle.finish(TransferStatus.FAILED, f"cannot reach the peer: {exc}")
            return
        self._outbound[record.seq] = record
        header = Header(
            writer_id=self._id,
            reply_address=self._worker_address,
            transfer_id=handle.transfer_id,
            slot=self._slot,
            seq=record.seq,
            timeout_s=max(0.0, handle.deadline - time.monotonic()),
            dst_regions=plan.dst_regions,
            messages=plan.messages,
            runs=plan.runs,
        )
        body = np.frombuffer(header.encode(), dtype=np.uint8)
        self._send(ep, record, make_tag(Kind.HEADER, self._slot, record.seq), body, 0)
        handle.start()
        record.ep = ep
        self._send_messages(record)

    def _send_messages(self, record: _Outbound) -> None:
        """Sends the DATA messages from ``record.next_message`` on (all of them, unless the
        last is held back by ``pause_before_last_s``; ``_poll_outbound`` resumes it)."""
        handle, plan = record.handle, record.plan
        src_views = [self._regions[n].host_view() for n in plan.src_regions]
        src_bases = np.array([self._regions[n].address for n in plan.src_regions], dtype=np.int64)
        while record.next_message < len(plan.messages):
            if handle.status.is_terminal:
                return
            index = record.next_message
            if self.pause_before_last_s and index == len(plan.messages) - 1:
                if record.resume_at is None:
                    record.resume_at = time.monotonic() + self.pause_before_last_s
                if time.monotonic() < record.resume_at:
                    return
            message = plan.messages[index]
            record.next_message += 1
            runs = plan.runs[message.run_start : message.run_end]
            tag = make_tag(Kind.DATA, self._slot, record.seq, index)
            # Runs that follow on at the source go as one buffer; scattered ones as an IOV list
            # read in place (how the receiver lays them out is its own business).
            span = contiguous_span(runs, SRC, SRC_OFF)
            if span is None:
                iov = ucp_native.iov_table(src_bases, runs, SRC, SRC_OFF, LEN)
                request = ucp_native.send_iov(record.ep.handle, iov, tag)  # type: ignore[attr-defined]
                record.pending.append((request, message.num_bytes, iov))
            else:
                region, offset, length = span
                buffer = src_views[region][offset : offset + length]
                self._send(record.ep, record, tag, buffer, message.num_bytes)

    def _send(self, ep: object, record: _Outbound, tag: int, buffer: np.ndarray, n: int) -> None:
        request = ep.tag_send(Array(buffer), ucx_api.UCXXTag(tag))  # type: ignore[attr-defined]
        record.pending.append((request, n, buffer))

    def _abort(self, seq: int) -> None:
        record = self._outbound.get(seq)
        if record is None or record.is_abort_sent:
            return
        record.is_abort_sent = True
        ep = self._endpoints.get(record.peer_id)
        if ep is not None and record.peer_id not in self._closed_peers:
            tag = make_tag(Kind.ABORT, self._slot, seq)
            self._send_small(ep, tag, np.zeros(1, dtype=np.uint8))

    def _poll_outbound(self) -> bool:
        is_busy = False
        now = time.monotonic()
        for seq, record in list(self._outbound.items()):
            handle = record.handle
            if record.next_message < len(record.plan.messages) and not handle.status.is_terminal:
                self._send_messages(record)
            still: list[tuple[object, int, np.ndarray]] = []
            for request, n, buffer in record.pending:
                if not request.completed:  # type: ignore[attr-defined]
                    still.append((request, n, buffer))
                    continue
                is_busy = True
                try:
                    request.check_error()  # type: ignore[attr-defined]
                except Exception as exc:
                    if handle.finish(TransferStatus.FAILED, f"send failed: {exc}"):
                        self._abort(seq)
                    continue
                handle.add_bytes(n)
            record.pending = still
            if not handle.status.is_terminal and now > handle.deadline:
                handle.finish(TransferStatus.TIMED_OUT, "the deadline passed before the ACK")
            if handle.status.is_terminal:
                if handle.status is not TransferStatus.DONE:
                    self._abort(seq)
                del self._outbound[seq]
                if record.pending:
                    self._abandoned.append((now, record))
        # Sends of ended transfers keep their source buffers alive until they complete.
        kept = []
        for since, record in self._abandoned:
            record.pending = [p for p in record.pending if not p[0].completed]  # type: ignore[attr-defined]
            if record.pending and now - since < _ABANDON_AFTER_S:
                kept.append((since, record))
        self._abandoned = kept
        return is_busy

    def _on_message(self, probe: ProbedMessage) -> None:
        kind, slot, seq, index = split_tag(probe.tag)
        if kind is Kind.DATA:
            self._on_data(probe, (slot, seq), index)
            return
        body = self._recv_now(probe)
        if kind is Kind.HEADER:
            self._on_header(Header.decode(body))
        elif kind is Kind.ACK and slot == self._slot:
            self._on_ack(seq, body)
        elif kind is Kind.ABORT:
            self._drop((slot, seq), TransferStatus.CANCELLED, "aborted by the writer", False)
        elif kind is Kind.HELLO:
            writer_id = bytes(body[:_ID_BYTES])
            ep = self._reply_endpoint(writer_id, bytes(body[_ID_BYTES:]))
            welcome = np.frombuffer(self._id, dtype=np.uint8)
            self._send_small(ep, make_tag(Kind.WELCOME, self._slot, 0), welcome)
        elif kind is Kind.WELCOME:
            self._welcomed.setdefault(bytes(body[:_ID_BYTES]), threading.Event()).set()
        elif kind is Kind.BYE:
            self._on_bye(bytes(body[:_ID_BYTES]))

    def _on_header(self, header: Header) -> None:
        key = (header.slot, header.seq)
        ep = self._reply_endpoint(header.writer_id, header.reply_address)
        refusal = self._check_header(header)
        if refusal is None:
            refusal = self.inbound.begin(header.transfer_id)
        if refusal is not None:
            logger.warning("refusing KV transfer %r: %s", header.transfer_id, refusal)
            self._ack(ep, key, TransferStatus.FAILED, refusal)
            return
        self._slot_owners[header.slot] = header.writer_id
        self._inbound[key] = _Inbound(
            header=header,
            deadline=time.monotonic() + header.timeout_s + _RECEIVER_GRACE_S,
            dst_views=[self._regions[n].host_view() for n in header.dst_regions],
            dst_bases=np.array(
                [self._regions[n].address for n in header.dst_regions], dtype=np.int64
            ),
            num_remaining=len(header.messages),
        )

    def _check_header(self, header: Header) -> str | None:
        owner = self._slot_owners.get(header.slot)
        if owner is not None and owner != header.writer_id:
            return f"writer slot {header.slot} is held by another writer"
        return header.problem(self.region_lengths())

    def _on_data(self, probe: ProbedMessage, key: tuple[int, int], index: int) -> None:
        record = self._inbound.get(key)
        length = probe.length
        if record is None or record.is_dropped or index >= len(record.header.messages):
            self._drain(probe)
            return
        message = record.header.messages[index]
        if length != message.num_bytes:
            self._drain(probe)
            self._drop(key, TransferStatus.FAILED, f"message {index} has {length} bytes")
            return
        if not self.inbound.begin_write(record.header.transfer_id):
            self._drain(probe)
            return
        # Received in place: a contiguous span as one buffer, scattered blocks as an IOV list.
        runs = record.header.runs[message.run_start : message.run_end]
        span = contiguous_span(runs, DST, DST_OFF)
        if span is None:
            iov = ucp_native.iov_table(record.dst_bases, runs, DST, DST_OFF, LEN)
            request = ucp_native.receive_iov(self._worker.handle, probe, iov)
        else:
            region, offset, _ = span
            target = record.dst_views[region][offset : offset + length]
            request = ucp_native.receive(self._worker.handle, probe, target)
        record.pending.append((request, index))

    def _drain(self, probe: ProbedMessage) -> None:
        scratch = np.empty(max(probe.length, 1), dtype=np.uint8)
        self._drains.append((ucp_native.receive(self._worker.handle, probe, scratch), scratch))

    def _poll_drains(self) -> bool:
        before = len(self._drains)
        self._drains = [d for d in self._drains if not d[0].completed]  # type: ignore[attr-defined]
        return len(self._drains) != before

    def _poll_inbound(self) -> bool:
        is_busy = False
        now = time.monotonic()
        for key, record in list(self._inbound.items()):
            tid = record.header.transfer_id
            still: list[tuple[object, int]] = []
            for request, index in record.pending:
                if not request.completed:  # type: ignore[attr-defined]
                    still.append((request, index))
                    continue
                is_busy = True
                try:
                    request.check_error()  # type: ignore[attr-defined]
                except Exception as exc:
                    self.inbound.end_write(tid, 0)
                    self._drop(key, TransferStatus.FAILED, f"receive failed: {exc}")
                    continue
                self.inbound.end_write(tid, record.header.messages[index].num_bytes)
                record.num_remaining -= 1
            record.pending = still
            status = self.inbound.status(tid)
            if not record.is_dropped and status is not None and status.is_terminal:
                # Fenced by the receiver: tell the writer to stop.
                self._drop(key, status, self.inbound.error(tid) or "ended by the receiver")
            elif not record.is_dropped and record.num_remaining == 0:
                self.inbound.finish(tid, TransferStatus.DONE)
                ep = self._reply_endpoints.get(record.header.writer_id)
                if ep is not None:
                    self._ack(ep, key, TransferStatus.DONE, "")
                del self._inbound[key]
                continue
            elif not record.is_dropped and now > record.deadline:
                self._drop(key, TransferStatus.TIMED_OUT, "no progress by the writer's deadline")
            if record.is_dropped and not record.pending:
                del self._inbound[key]
        return is_busy

    def _drop(
        self, key: tuple[int, int], status: TransferStatus, reason: str, tell_writer: bool = True
    ) -> None:
        """Ends an inbound transfer early; its later messages are drained, never written."""
        record = self._inbound.get(key)
        if record is None or record.is_dropped:
            return
        record.is_dropped = True
        self.inbound.finish(record.header.transfer_id, status, reason)
        ep = self._reply_endpoints.get(record.header.writer_id)
        if tell_writer and ep is not None:
            self._ack(ep, key, TransferStatus.FAILED, reason)

    def _ack(self, ep: object, key: tuple[int, int], status: TransferStatus, reason: str) -> None:
        code = bytes([_STATUS_CODES.index(status)])
        body = np.frombuffer(code + reason.encode(), dtype=np.uint8)
        self._send_small(ep, make_tag(Kind.ACK, key[0], key[1]), body)

    def _on_ack(self, seq: int, body: np.ndarray) -> None:
        record = self._outbound.get(seq)
        if record is None:
            return
        status = _STATUS_CODES[int(body[0])]
        reason = bytes(body[1:]).decode() or None
        if status is TransferStatus.DONE:
            record.handle.finish(TransferStatus.DONE)
        else:
            record.handle.finish(TransferStatus.FAILED, f"the receiver refused: {reason}")
            record.is_abort_sent = True

    def _on_bye(self, peer_id: bytes) -> None:
        self._closed_peers.add(peer_id)
        for record in self._outbound.values():
            if record.peer_id == peer_id:
                record.is_abort_sent = True
                record.handle.finish(TransferStatus.FAILED, "the peer closed")
        for key, inbound in list(self._inbound.items()):
            if inbound.header.writer_id == peer_id:
                self._drop(key, TransferStatus.FAILED, "the writer closed", False)
        self._endpoints.pop(peer_id, None)
        self._reply_endpoints.pop(peer_id, None)

    def _say_bye(self) -> None:
        self._step()  # hear any HELLO still queued, so that writer hears the BYE too
        body = np.frombuffer(self._id, dtype=np.uint8)
        peers = {**self._reply_endpoints, **self._endpoints}
        for ep in peers.values():
            self._send_small(ep, make_tag(Kind.BYE, self._slot, 0), body)
        limit = time.monotonic() + 1.0
        while self._drains and time.monotonic() < limit:
            self._worker.progress()
            self._poll_drains()


register_transport(UcxTransport.name, UcxTransport)
