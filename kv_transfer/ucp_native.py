"""Direct libucp calls for what ucxx's Python bindings lack: probing and receiving tagged messages
by message handle, and scatter-gather (IOV) sends and receives.

Why: KV pages are scattered on both sides of a push (prefill blocks from the prefix cache, decode
blocks from a free list). ucxx only moves contiguous buffers, so scattered pages had to be packed
into a staging buffer on the writer and unpacked on the receiver: three copies instead of one, and
45-61 % of `ucx_perftest`'s bandwidth on this host. With `UCP_DATATYPE_IOV` on both sides UCX
moves each page from its source block straight into its destination block (over shared memory
that is one `process_vm_readv` of up to 1024 pages).

These calls use the context, worker and endpoints that ucxx created (their `handle` attributes),
through the libucp that ucxx loaded, and must be made by the thread that progresses the worker
(the transport's agent). Requests carry no callback: their owner polls `UcpRequest.completed`.

A request's life cycle: posted (in flight, or complete at once when UCX returns no request) →
complete (its status read once, the UCX request freed) → `check_error()` raises if it failed.
Every buffer and IOV table a request reads or writes must stay alive until it is complete.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import libucx
import numpy as np

_UCS_OK = 0
_UCS_INPROGRESS = 1
# UCS_PTR_IS_ERR: an error status is returned as a pointer in the top 100 addresses.
_UCS_ERR_LAST = -100
_POINTER_SPACE = 1 << 64
_UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3
_UCP_DATATYPE_CONTIG_BYTES = (1 << 3) | 0  # ucp_dt_make_contig(1)
_UCP_DATATYPE_IOV = 2


class _RequestParam(ctypes.Structure):
    """ucp_request_param_t (ucp.h, UCX 1.12+); only op_attr_mask and datatype are set here."""

    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


class _TagRecvInfo(ctypes.Structure):
    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


def _load() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    # The same libraries ucxx loaded (dlopen of an already-open path returns that handle): the
    # handles below are only valid in that copy of libucp.
    libraries = {
        lib._name.rsplit("/", 1)[-1].split(".so")[0]: lib
        for lib in libucx.load_library()
        if lib is not None  # a library libucx could not find (ucxx then fails to import first)
    }
    ucp, ucs = libraries["libucp"], libraries["libucs"]
    ptr, u64, param = ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(_RequestParam)
    # name: (return type, argument types), as declared in ucp.h / status.h.
    signatures = {
        "ucp_tag_probe_nb": (ptr, [ptr, u64, u64, ctypes.c_int, ctypes.POINTER(_TagRecvInfo)]),
        "ucp_tag_msg_recv_nbx": (ptr, [ptr, ptr, ctypes.c_size_t, ptr, param]),
        "ucp_tag_send_nbx": (ptr, [ptr, ptr, ctypes.c_size_t, u64, param]),
        "ucp_request_check_status": (ctypes.c_int, [ptr]),
        "ucp_request_free": (None, [ptr]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(ucp, name)
        function.restype, function.argtypes = restype, argtypes
    ucs.ucs_status_string.restype = ctypes.c_char_p
    ucs.ucs_status_string.argtypes = [ctypes.c_int]
    return ucp, ucs


_ucp, _ucs = _load()
_CONTIG = _RequestParam(
    op_attr_mask=_UCP_OP_ATTR_FIELD_DATATYPE, datatype=_UCP_DATATYPE_CONTIG_BYTES
)
_IOV = _RequestParam(op_attr_mask=_UCP_OP_ATTR_FIELD_DATATYPE, datatype=_UCP_DATATYPE_IOV)


class UcpError(RuntimeError):
    pass


def _status_text(status: int) -> str:
    return str(_ucs.ucs_status_string(status).decode())


class UcpRequest:
    """One send or receive; `completed` polls it (the worker must be progressed meanwhile)."""

    def __init__(self, pointer: int | None, keep: tuple[object, ...]) -> None:
        self._status = _UCS_OK
        self._pointer: int | None = None
        # Buffers and IOV tables UCX reads or writes until completion.
        self._keep: tuple[object, ...] = ()
        if pointer is None:  # completed at once
            return
        if pointer >= _POINTER_SPACE + _UCS_ERR_LAST:
            self._status = pointer - _POINTER_SPACE
            return
        self._pointer = pointer
        self._keep = keep

    @property
    def completed(self) -> bool:
        if self._pointer is None:
            return True
        status = _ucp.ucp_request_check_status(self._pointer)
        if status == _UCS_INPROGRESS:
            return False
        self._status = status
        _ucp.ucp_request_free(self._pointer)
        self._pointer = None
        self._keep = ()
        return True

    def check_error(self) -> None:
        if self._status != _UCS_OK:
            raise UcpError(_status_text(self._status))


@dataclass(frozen=True)
class ProbedMessage:
    """A tagged message that has arrived and been taken off UCX's unexpected queue: it must be
    received (into its target, or into scratch) exactly once."""

    tag: int
    length: int
    handle: int


def probe(worker_handle: int) -> ProbedMessage | None:
    """The next arrived tagged message of any tag, removed from the queue; None if there is none."""
    info = _TagRecvInfo()
    handle = _ucp.ucp_tag_probe_nb(worker_handle, 0, 0, 1, ctypes.byref(info))
    if not handle:
        return None
    return ProbedMessage(int(info.sender_tag), int(info.length), int(handle))


def receive(worker_handle: int, message: ProbedMessage, buffer: np.ndarray) -> UcpRequest:
    """Receives `message` into one contiguous uint8 buffer of at least its length."""
    pointer = _ucp.ucp_tag_msg_recv_nbx(
        worker_handle, buffer.ctypes.data, buffer.nbytes, message.handle, ctypes.byref(_CONTIG)
    )
    return UcpRequest(pointer, (buffer,))


def receive_iov(worker_handle: int, message: ProbedMessage, iov: np.ndarray) -> UcpRequest:
    """Receives `message` into the (address, length) pieces of `iov` (uint64 [n, 2]), in order."""
    pointer = _ucp.ucp_tag_msg_recv_nbx(
        worker_handle, iov.ctypes.data, len(iov), message.handle, ctypes.byref(_IOV)
    )
    return UcpRequest(pointer, (iov,))


def send_iov(ep_handle: int, iov: np.ndarray, tag: int) -> UcpRequest:
    """Sends the (address, length) pieces of `iov` (uint64 [n, 2]) as one tagged message."""
    pointer = _ucp.ucp_tag_send_nbx(ep_handle, iov.ctypes.data, len(iov), tag, ctypes.byref(_IOV))
    return UcpRequest(pointer, (iov,))


def iov_table(
    bases: np.ndarray, runs: np.ndarray, region_col: int, offset_col: int, len_col: int
) -> np.ndarray:
    """uint64 [num_runs, 2] of (address, length): one side of `runs`, whose regions start at
    `bases` (int64 [num_regions]). The layout is ucp_dt_iov_t's (void *buffer; size_t length)."""
    table = np.empty((len(runs), 2), dtype=np.uint64)
    table[:, 0] = bases[runs[:, region_col]] + runs[:, offset_col]
    table[:, 1] = runs[:, len_col]
    return table
