"""The shm transport: KV pages between processes of one host through shared memory.

The receiver (decode node) keeps its KV cache in memfd shared memory (`kv_transfer.shared_memory`,
registered as HOST_SHM regions) next to a control region holding its transfer records
(`shm_table.ShmTable`). Its address carries the handles of both: owner pid, fd and inode. The
writer (prefill node) maps them once per peer, through /proc/<pid>/fd, and copies each page from
its own block into the reserved block: no staging buffer, no socket, no agent thread on either
side. A batch of runs is one call of the compiled scatter-gather copy (`native_copy`), or, where
it cannot be built, numpy through a 256 KiB bounce buffer that stays in the CPU cache. The
fence is the table's: each copy holds the transfer's slot mutex and first checks the slot's
generation and fence flag, and the receiver's `fence()` waits until it holds that mutex itself
(see shm_table.py and design §3).

A transfer's life on the writer: write() plans it and maps the peer (PENDING); a copy thread
claims a slot in the peer's table (IN_PROGRESS on both sides) and copies message by message,
checking cancel, deadline, the peer's liveness and the fence before each; it then marks the slot
DONE and ends the handle DONE only if the slot still says so (a fence after the last copy wins:
FAILED). Cancel / deadline / close end the slot CANCELLED / TIMED_OUT / FAILED. On the receiver
nothing runs: its records change under it, and a writer that died is reported FAILED by its pid.

Peer death: a receiver killed mid-copy is seen before the next message (FAILED, "the peer process
died") and its mapping is dropped, so its memory is freed when the last copy using it ends.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from kv_transfer import shared_memory
from kv_transfer.memory import MemoryKind
from kv_transfer.native_copy import copy_runs_native, native_copy_error
from kv_transfer.page_copy import PageCopy
from kv_transfer.page_table import PageTable
from kv_transfer.peer_address import PeerAddress
from kv_transfer.region import RegionHandle
from kv_transfer.shared_memory import SharedHandle
from kv_transfer.shm_table import CONTROL_BYTES, ShmTable
from kv_transfer.transfer_handle import TransferHandle
from kv_transfer.transfer_plan import (
    DST,
    DST_OFF,
    LEN,
    MAX_STAGED_BYTES,
    SRC,
    SRC_OFF,
    TransferPlan,
)
from kv_transfer.transfer_status import TransferStatus
from kv_transfer.transport import KvTransport, TransportInfo, register_transport

logger = logging.getLogger(__name__)

# Copy threads per writer: concurrent pushes to several requests proceed side by side.
DEFAULT_COPY_THREADS = 4
# Destination region lists a writer remembers per peer (one per address and set of regions
# written: a node writes all of its layers, so one or two in practice).
MAX_CACHED_DST_BASES = 64


@dataclass
class _Peer:
    """A receiver as this writer maps it (once per peer)."""

    pid: int
    table: ShmTable
    # The peer's allocations mapped here, each once: by inode (shm: the mapping) or by IPC
    # handle (cuda_ipc: the opened device pointer).
    mappings: dict[object, object]
    watch: shared_memory.ProcessWatch
    is_dead: bool = False
    # Addresses in this process of the regions a write names, int64 [num_dst_regions] (read
    # only), by the peer address that published them (its endpoint and region lengths) and
    # those regions' names: a write to a known peer looks up no region (~3 us each).
    dst_bases: dict[tuple[bytes, tuple[str, ...], tuple[int, ...]], np.ndarray] = field(
        default_factory=dict
    )


@lru_cache(maxsize=256)
def _endpoint(endpoint: bytes) -> dict[str, Any]:
    """A peer address's endpoint document, parsed once per peer rather than once per write and
    region (read only: shared by every write to that peer)."""
    doc = json.loads(endpoint)
    if not isinstance(doc, dict):
        raise ValueError("the endpoint is not a JSON object")
    return doc


@dataclass
class _Job:
    handle: TransferHandle
    plan: TransferPlan
    peer: _Peer
    # Address of each destination region's first byte in this process, and its bytes:
    # int64 [num_dst_regions] each.
    dst_bases: np.ndarray
    dst_lengths: np.ndarray


class ShmTransport(KvTransport):
    name = "shm"
    memory_kinds = frozenset({MemoryKind.HOST, MemoryKind.HOST_SHM})
    # What receiving regions must be: the receiver publishes only these.
    receive_kind = MemoryKind.HOST_SHM

    def __init__(
        self,
        pause_before_last_s: float = 0.0,
        stall: bool = False,
        copy_threads: int = DEFAULT_COPY_THREADS,
        native_copy: bool = True,
    ) -> None:
        """``pause_before_last_s`` and ``stall`` are fault injection for tests: each write holds
        its last message back that long, or never finishes (cancel, deadline and close end it).
        ``native_copy=False`` keeps the writer on the numpy copy (the benchmark's comparison)."""
        super().__init__()
        self.pause_before_last_s = pause_before_last_s
        self.stall = stall
        self.native_copy = native_copy
        self._control = shared_memory.allocate(CONTROL_BYTES, name="pdserve-kv-control")
        self.inbound: ShmTable = ShmTable(self._control, owner=True)
        self._peers: dict[tuple[int, int], _Peer] = {}
        self._lock = threading.Lock()
        self._active: set[TransferHandle] = set()
        self._is_closed = False
        self._pool = ThreadPoolExecutor(copy_threads, thread_name_prefix="kv-shm-copy")

    # Public API.

    def allocate(self, num_bytes: int) -> np.ndarray:
        return shared_memory.allocate(num_bytes)

    def address(self) -> PeerAddress:
        control = shared_memory.find_allocation(self._control.ctypes.data, CONTROL_BYTES)
        assert control is not None
        regions, lengths = {}, {}
        for name, region in self._regions.items():
            if region.memory is not self.receive_kind:
                continue  # a source only: peers cannot map it
            exported = self._export(region)
            if exported is not None:
                regions[name] = exported
                lengths[name] = region.length
        endpoint = {
            "host": shared_memory.host_identity(),
            "control": control[0].to_json(),
            "regions": regions,
        }
        return PeerAddress(self.name, json.dumps(endpoint).encode(), lengths)

    def connect(self, peer: PeerAddress, timeout: float = 5.0) -> None:
        self._peer(peer)

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
        dst_lengths = np.array([peer.regions[n] for n in plan.dst_regions], dtype=np.int64)
        try:
            mapped = self._peer(peer)
            dst_bases = self._dst_bases(mapped, peer, plan.dst_regions, dst_lengths)
        except ConnectionError as exc:
            handle.finish(TransferStatus.FAILED, str(exc))
            return handle
        with self._lock:
            self._active.add(handle)
        self._pool.submit(self._run, _Job(handle, plan, mapped, dst_bases, dst_lengths))
        return handle

    def info(self) -> TransportInfo:
        # The copy path is the lane: a build that failed shows here, not only in a debug log.
        error = native_copy_error() if self.native_copy else "native copy off"
        lane = "memfd/native-copy" if error is None else f"memfd/numpy-copy ({error})"
        return TransportInfo(self.name, [lane], f"linux {os.uname().release}")

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        self.inbound.close()
        with self._lock:
            active = list(self._active)
        for handle in active:
            handle.finish(TransferStatus.FAILED, "the writer's transport was closed")
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._peers.clear()

    # Mapping peers.

    def _peer(self, peer: PeerAddress) -> _Peer:
        if peer.transport != self.name:
            raise ValueError(f"a {peer.transport} address cannot be reached over {self.name}")
        try:
            doc = _endpoint(peer.endpoint)
            control = SharedHandle.from_json(doc["control"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConnectionError(f"not a {self.name} peer address: {exc}") from None
        if doc.get("host") != shared_memory.host_identity():
            raise ConnectionError(
                f"the {self.name} peer runs on another host or PID namespace "
                f"({doc.get('host')}); use the ucx transport across hosts"
            )
        key = (control.pid, control.inode)
        with self._lock:
            # Dead peers' mappings go (their memory is freed once no copy uses it any more).
            for old_key, old in list(self._peers.items()):
                if old.is_dead or not old.watch.is_alive():
                    del self._peers[old_key]
            mapped = self._peers.get(key)
            if mapped is not None:
                return mapped
            view = np.frombuffer(shared_memory.map_peer(control), dtype=np.uint8)
            mapped = _Peer(
                control.pid,
                ShmTable(view, owner=False),
                {},
                shared_memory.ProcessWatch(control.pid),
            )
            # Every region published now is mapped now, once (later ones on first use).
            for name, region in doc.get("regions", {}).items():
                self._map(mapped, region, peer.regions[name])
            self._peers[key] = mapped
            return mapped

    def _dst_bases(
        self, mapped: _Peer, peer: PeerAddress, names: list[str], lengths: np.ndarray
    ) -> np.ndarray:
        """This process's address of each of the peer's regions `names` (int64 [len(names)],
        read only; `lengths` their bytes), computed once per address that names them: a peer
        that publishes a new address (a region registered again) is looked up anew."""
        key = (peer.endpoint, tuple(names), tuple(lengths.tolist()))
        bases = mapped.dst_bases.get(key)
        if bases is None:
            bases = np.array([self._dst_base(mapped, peer, name) for name in names], np.int64)
            bases.flags.writeable = False  # shared by every write that finds it here
            with self._lock:
                if len(mapped.dst_bases) >= MAX_CACHED_DST_BASES:
                    mapped.dst_bases.clear()
                mapped.dst_bases[key] = bases
        return bases

    def _dst_base(self, mapped: _Peer, peer: PeerAddress, name: str) -> int:
        """This process's address of the peer's region `name`, mapping it on first use."""
        doc = _endpoint(peer.endpoint)["regions"].get(name)
        if doc is None:
            raise ConnectionError(f"the peer's region {name!r} is not in shared memory")
        with self._lock:
            return self._map(mapped, doc, peer.regions[name])

    # What differs between host shared memory and device memory (cuda_ipc overrides these).

    def _export(self, region: RegionHandle) -> dict[str, object] | None:
        """How a peer maps `region` (None: it cannot, e.g. released since registered)."""
        found = shared_memory.find_allocation(region.address, region.length)
        if found is None:
            return None
        handle, offset = found
        return {**handle.to_json(), "offset": offset}

    def _map(self, mapped: _Peer, doc: dict[str, Any], length: int) -> int:
        """Maps a peer region's allocation (once per peer, under ``_lock``); its first byte's
        address in this process."""
        handle, offset = SharedHandle.from_json(doc), int(doc["offset"])
        array = mapped.mappings.get(handle.inode)
        if not isinstance(array, np.ndarray):
            array = np.frombuffer(shared_memory.map_peer(handle), dtype=np.uint8)
            mapped.mappings[handle.inode] = array
        if offset + length > array.nbytes:
            raise ConnectionError("a peer region lies outside its shared memory")
        return int(array.ctypes.data) + offset

    def _batches(self, plan: TransferPlan) -> list[tuple[np.ndarray, int]]:
        """(runs, bytes) copied under one hold of the slot mutex: the plan's messages (at most
        MAX_STAGED_BYTES of small pages, or one long run), so a fence waits for one at most;
        a transfer of at most MAX_STAGED_BYTES in all is one batch (no messages to make)."""
        if plan.num_bytes <= MAX_STAGED_BYTES:
            return [(plan.runs, plan.num_bytes)]
        return [(plan.runs[m.run_start : m.run_end], m.num_bytes) for m in plan.messages]

    def _prepare_copy(self) -> None:
        """Runs once per transfer before its slot is claimed: builds or loads the native copy on
        first use, so no build ever happens while a slot mutex is held."""
        if self.native_copy:
            native_copy_error()

    def _copy_batch(
        self,
        runs: np.ndarray,
        src_bases: np.ndarray,
        dst_bases: np.ndarray,
        src_lengths: np.ndarray,
        dst_lengths: np.ndarray,
    ) -> None:
        """Copies `runs` and returns once every byte has landed (bases and lengths: int64
        [num_regions] of each side)."""
        if self.native_copy:
            copy_runs(runs, src_bases, dst_bases, src_lengths, dst_lengths)
        else:
            copy_runs_numpy(runs, src_bases, dst_bases)

    # Copy threads.

    def _run(self, job: _Job) -> None:
        try:
            self._copy(job)
        except Exception as exc:  # a bug must fail the transfer, not vanish in the pool
            logger.exception("shm transfer %s failed", job.handle.transfer_id)
            job.handle.finish(TransferStatus.FAILED, f"internal error: {exc!r}")
        finally:
            with self._lock:
                self._active.discard(job.handle)

    def _copy(self, job: _Job) -> None:
        handle, plan, table = job.handle, job.plan, job.peer.table
        if handle.status.is_terminal or self._peer_gone(job):
            return
        self._prepare_copy()
        claim = table.claim(handle.transfer_id)
        if isinstance(claim, str):
            handle.finish(TransferStatus.FAILED, claim)
            return
        slot, generation = claim
        handle.start()
        src_bases = np.array([self._regions[n].address for n in plan.src_regions], dtype=np.int64)
        src_lengths = np.array([self._regions[n].length for n in plan.src_regions], dtype=np.int64)
        batches = self._batches(plan)
        last = len(batches) - 1
        for index, (runs, num_bytes) in enumerate(batches):
            if index == last and self.pause_before_last_s:
                resume_at = time.monotonic() + self.pause_before_last_s
                while time.monotonic() < resume_at and self._should_go_on(job, slot, generation):
                    time.sleep(0.002)
            while self.stall and self._should_go_on(job, slot, generation):
                time.sleep(0.002)
            if not self._should_go_on(job, slot, generation):
                return
            wait = max(0.0, handle.deadline - time.monotonic())
            if not table.begin_copy(slot, generation, wait):
                self._end(job, slot, generation, TransferStatus.FAILED, "fenced by the receiver")
                return
            try:
                self._copy_batch(runs, src_bases, job.dst_bases, src_lengths, job.dst_lengths)
            finally:
                table.end_copy(slot, num_bytes)
            handle.add_bytes(num_bytes)
        if table.finish_claim(slot, generation, TransferStatus.DONE) is TransferStatus.DONE:
            handle.finish(TransferStatus.DONE)
        else:
            handle.finish(TransferStatus.FAILED, "fenced by the receiver")

    def _should_go_on(self, job: _Job, slot: int, generation: int) -> bool:
        """Ends the transfer if it was cancelled, timed out, or an end closed or died."""
        handle, table = job.handle, job.peer.table
        if handle.status.is_terminal:  # cancelled, or failed by close()
            reason = handle.error or "aborted by the writer"
            table.finish_claim(slot, generation, handle.status, reason)
            return False
        if self._peer_gone(job):
            return False
        if table.is_closed or self._is_closed:
            self._end(job, slot, generation, TransferStatus.FAILED, "the peer was closed")
            return False
        if time.monotonic() > handle.deadline:
            self._end(job, slot, generation, TransferStatus.TIMED_OUT, "the deadline passed")
            return False
        return True

    def _peer_gone(self, job: _Job) -> bool:
        if job.peer.watch.is_alive():
            return False
        job.peer.is_dead = True
        with self._lock:  # unmapped once the last job holding it ends
            for key, mapped in list(self._peers.items()):
                if mapped is job.peer:
                    del self._peers[key]
        job.handle.finish(TransferStatus.FAILED, "the peer process died")
        return True

    def _end(
        self, job: _Job, slot: int, generation: int, status: TransferStatus, error: str
    ) -> None:
        job.peer.table.finish_claim(slot, generation, status, error)
        job.handle.finish(status, error)


_memmove = ctypes.memmove
# Without the native copy, KV pages scattered on both sides go through a bounce buffer this many
# pages long, small enough to stay in the core's L2 cache: DRAM sees one read and one write per
# byte, and numpy moves 32 pages per call instead of Python making one call per page.
BOUNCE_PAGES = 32


def copy_runs(
    runs: np.ndarray,
    src_bases: np.ndarray,
    dst_bases: np.ndarray,
    src_lengths: np.ndarray,
    dst_lengths: np.ndarray,
) -> None:
    """Copies each run from its source to its destination address and returns when every byte
    is in place. runs: int64 [num_runs, 5] as in TransferPlan; bases and lengths: int64
    [num_regions], each side's regions in this process. The native copy checks every run against
    the lengths (ValueError before any byte moves); the numpy fallback relies on make_plan's."""
    if native_copy_error() is None:
        copy_runs_native(runs, src_bases, src_lengths, dst_bases, dst_lengths)
        return
    copy_runs_numpy(runs, src_bases, dst_bases)


def copy_runs_numpy(runs: np.ndarray, src_bases: np.ndarray, dst_bases: np.ndarray) -> None:
    """The fallback copy: numpy for uniform KV pages, one memmove per run otherwise."""
    if len(runs) > 1 and _copy_uniform_pages(runs, src_bases, dst_bases):
        return
    src = (src_bases[runs[:, SRC]] + runs[:, SRC_OFF]).tolist()
    dst = (dst_bases[runs[:, DST]] + runs[:, DST_OFF]).tolist()
    # map() drained by a zero-length deque: no Python bytecode per run. ctypes releases the GIL
    # for each memmove.
    deque(map(_memmove, dst, src, runs[:, LEN].tolist()), maxlen=0)


def _copy_uniform_pages(runs: np.ndarray, src_bases: np.ndarray, dst_bases: np.ndarray) -> bool:
    """The KV case: equal pages at multiples of their size, one region per side, moved as rows
    of [pages, page_bytes] views with numpy's fancy indexing. False if it does not apply."""
    page = int(runs[0, LEN])
    if (
        (runs[:, LEN] != page).any()
        or (runs[:, SRC] != runs[0, SRC]).any()
        or (runs[:, DST] != runs[0, DST]).any()
        or (runs[:, SRC_OFF] % page).any()
        or (runs[:, DST_OFF] % page).any()
    ):
        return False
    src_rows = runs[:, SRC_OFF] // page
    dst_rows = runs[:, DST_OFF] // page
    src = _rows(int(src_bases[runs[0, SRC]]), int(src_rows.max()) + 1, page)
    dst = _rows(int(dst_bases[runs[0, DST]]), int(dst_rows.max()) + 1, page)
    first = int(src_rows[0])
    if (np.diff(src_rows) == 1).all():
        # In order at the source (fresh prefill blocks): one scatter, straight from the blocks.
        dst[dst_rows] = src[first : first + len(runs)]
        return True
    bounce = np.empty((BOUNCE_PAGES, page), dtype=np.uint8)
    for at in range(0, len(runs), BOUNCE_PAGES):
        rows = src_rows[at : at + BOUNCE_PAGES]
        staged = bounce[: len(rows)]
        # mode="clip" skips numpy's buffered bounds check; make_plan checked the bounds.
        np.take(src, rows, axis=0, out=staged, mode="clip")
        dst[dst_rows[at : at + BOUNCE_PAGES]] = staged
    return True


def _rows(address: int, num_rows: int, page: int) -> np.ndarray:
    """A [num_rows, page] uint8 view of memory at `address` (no copy, no ownership)."""
    buffer = (ctypes.c_ubyte * (num_rows * page)).from_address(address)
    return np.frombuffer(memoryview(buffer), dtype=np.uint8).reshape(num_rows, page)


register_transport(ShmTransport.name, ShmTransport)
