"""The cuda_ipc transport: KV pages between GPU processes of one host, device to device.

A thin layer over the shm transport's protocol (`kv_transfer.shm`): the same control table in
host shared memory, the same claim / copy-under-the-slot-mutex / fence, the same liveness
checks; only the memory differs. The receiver publishes, per CUDA region, a CUDA IPC handle
(``cudaIpcGetMemHandle`` of the allocation holding it) and the region's offset in that
allocation; the writer opens each handle once per peer (``cudaIpcOpenMemHandle`` with lazy peer
access, so GPUs with peer access copy over NVLink / PCIe P2P directly) and copies its pages
with one gather-scatter kernel per batch on its own stream, then waits for an event recorded
after it. The slot mutex is held until that event completes, so "no writer inside a copy" also
means "no copy still running on a GPU", and the fence holds as it does for shm.

CuPy is imported here only (the GPU image installs it: the ``gpu`` extra); on a host without
CUDA creating this transport raises RuntimeError saying so. Its tests are ``gpu``-marked: run on
an H100 (two processes on one GPU), never in CI, which has no GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
from itertools import pairwise
from typing import Any

import numpy as np

from kv_transfer.memory import MemoryKind
from kv_transfer.region import RegionHandle
from kv_transfer.shm import ShmTransport, _Peer
from kv_transfer.transfer_plan import DST, DST_OFF, LEN, SRC, SRC_OFF, TransferPlan
from kv_transfer.transport import TransportInfo, register_transport

logger = logging.getLogger(__name__)

# Bytes copied under one hold of the slot mutex: one kernel launch and one event wait per batch
# (a 4 MiB batch would spend as long waiting on the event as copying, at NVLink speeds).
BATCH_BYTES = 64 << 20
_CUDA_MEMCPY_DEVICE_TO_DEVICE = 3

# One thread block per run; threads stride over the run in 16-byte words when both ends are
# 16-byte aligned and the length a multiple of 16 (KV pages are), else byte by byte.
_KERNEL = r"""
extern "C" __global__ void copy_runs(const unsigned long long* src, const unsigned long long* dst,
                                     const unsigned long long* len) {
    const unsigned long long s = src[blockIdx.x], d = dst[blockIdx.x], n = len[blockIdx.x];
    if (((s | d | n) & 15ULL) == 0) {
        const uint4* from = (const uint4*)s;
        uint4* to = (uint4*)d;
        for (unsigned long long i = threadIdx.x; i < n / 16; i += blockDim.x) to[i] = from[i];
    } else {
        const unsigned char* from = (const unsigned char*)s;
        unsigned char* to = (unsigned char*)d;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) to[i] = from[i];
    }
}
"""


def _cupy() -> Any:  # the cupy module (CuPy ships no type hints)
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            "the cuda_ipc KV transport needs CuPy (pip install 'pdserve[gpu]')"
        ) from exc
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise RuntimeError(f"the cuda_ipc KV transport needs a CUDA device: {exc}") from exc
    return cupy


def _allocation_start(pointer: int) -> int:
    """The first byte of the cudaMalloc allocation holding `pointer` (an IPC handle names the
    allocation; a torch tensor is usually a piece of a larger cached one)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    code = libcuda.cuMemGetAddressRange_v2(
        ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer)
    )
    if code != 0:
        raise RuntimeError(f"cuMemGetAddressRange failed with CUDA error {code}")
    return base.value


class CudaIpcTransport(ShmTransport):
    name = "cuda_ipc"
    memory_kinds = frozenset({MemoryKind.CUDA})
    receive_kind = MemoryKind.CUDA

    def __init__(self, **options: object) -> None:
        self._cp = _cupy()
        super().__init__(**options)  # type: ignore[arg-type]
        self._kernel = self._cp.RawKernel(_KERNEL, "copy_runs")
        self._streams: dict[int, Any] = {}
        # The device this node's KV cache is on (its first CUDA region's); copies and opened
        # IPC handles live in its context.
        self._device: int | None = None

    def register(self, name: str, buffer: object) -> RegionHandle:
        region = super().register(name, buffer)
        if self._device is None:
            self._device = region.device
        return region

    def allocate(self, num_bytes: int) -> Any:  # a cupy.ndarray
        return self._cp.zeros(num_bytes, dtype=self._cp.uint8)

    def info(self) -> TransportInfo:
        runtime = self._cp.cuda.runtime
        count = runtime.getDeviceCount()
        peers = [
            f"{a}->{b}"
            for a in range(count)
            for b in range(count)
            if a != b and runtime.deviceCanAccessPeer(a, b)
        ]
        lanes = ["cuda_ipc/kernel"] + ([f"p2p/{','.join(peers)}"] if peers else [])
        return TransportInfo(
            self.name, lanes, f"cupy {self._cp.__version__} / cuda {runtime.runtimeGetVersion()}"
        )

    # Host shared memory → device memory.

    def _export(self, region: RegionHandle) -> dict[str, object] | None:
        runtime = self._cp.cuda.runtime
        with self._cp.cuda.Device(region.device):
            start = _allocation_start(region.address)
            handle = runtime.ipcGetMemHandle(start)
        return {
            "ipc": bytes(handle).hex(),
            "offset": region.address - start,
            "device": region.device,
            # CUDA refuses to open a handle in the process that made it: a writer in the same
            # process (the start-up self-test) uses the pointer itself.
            "pid": os.getpid(),
            "pointer": start,
        }

    def _map(self, mapped: _Peer, doc: dict[str, Any], length: int) -> int:
        if int(doc["pid"]) == os.getpid():
            return int(doc["pointer"]) + int(doc["offset"])
        key = doc["ipc"]
        base = mapped.mappings.get(key)
        if not isinstance(base, int):
            runtime = self._cp.cuda.runtime
            try:
                with self._cp.cuda.Device(self._device or 0):
                    base = int(
                        runtime.ipcOpenMemHandle(
                            bytes.fromhex(key), runtime.cudaIpcMemLazyEnablePeerAccess
                        )
                    )
            except Exception as exc:
                raise ConnectionError(f"cannot open the peer's CUDA IPC handle: {exc}") from exc
            mapped.mappings[key] = base
        return int(base) + int(doc["offset"])

    def _batches(self, plan: TransferPlan) -> list[tuple[np.ndarray, int]]:
        """(runs, bytes) copied under one hold of the slot mutex: the plan's runs cut after the
        run that reaches each multiple of BATCH_BYTES (one kernel launch and one event wait
        each). Found with one searchsorted: a 64 MiB push is 8,192 pages."""
        runs = plan.runs
        if not len(runs):
            return []
        # offsets[i]: bytes before run i; offsets[-1]: the whole transfer.
        offsets = np.concatenate(([0], np.cumsum(runs[:, LEN])))
        multiples = np.arange(BATCH_BYTES, int(offsets[-1]), BATCH_BYTES)
        cuts = np.unique(np.searchsorted(offsets[1:], multiples) + 1).tolist()
        bounds = [0, *(c for c in cuts if c < len(runs)), len(runs)]
        return [(runs[a:b], int(offsets[b] - offsets[a])) for a, b in pairwise(bounds)]

    def _prepare_copy(self) -> None:
        pass  # copies run on the GPU (the RawKernel of __init__): no host copy to build

    def _copy_batch(
        self,
        runs: np.ndarray,
        src_bases: np.ndarray,
        dst_bases: np.ndarray,
        src_lengths: np.ndarray,
        dst_lengths: np.ndarray,
    ) -> None:
        cp = self._cp
        device = self._device or 0
        cp.cuda.runtime.setDevice(device)  # this copy thread's current device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = cp.cuda.Stream(non_blocking=True)
        src = (src_bases[runs[:, SRC]] + runs[:, SRC_OFF]).astype(np.uint64)
        dst = (dst_bases[runs[:, DST]] + runs[:, DST_OFF]).astype(np.uint64)
        lengths = runs[:, LEN].astype(np.uint64)
        with stream:
            if len(runs) == 1:
                cp.cuda.runtime.memcpyAsync(
                    int(dst[0]), int(src[0]), int(lengths[0]), _CUDA_MEMCPY_DEVICE_TO_DEVICE,
                    stream.ptr,
                )  # fmt: skip
            else:
                table = cp.asarray(np.stack([src, dst, lengths]))
                self._kernel((len(runs),), (256,), (table[0], table[1], table[2]))
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
        done.synchronize()  # every byte landed before the slot mutex is released


register_transport(CudaIpcTransport.name, CudaIpcTransport)
