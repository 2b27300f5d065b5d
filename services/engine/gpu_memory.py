"""How many bytes of KV cache a GPU can hold, from a profiling forward pass.

Why: the KV cache gets what is left of ``gpu_memory_utilization x total`` after everything else
the node needs at its worst step: weights, the activations of a step of
``max_num_batched_tokens`` tokens (and the logits of ``max_num_seqs`` samples), and memory
outside torch's allocator (CUDA context, cuBLAS workspaces). Sizing from "what is free after
the weights" instead leaves no room for activations, and the first long prefill runs out of
memory.

The arithmetic is a pure function over a ``MemorySnapshot`` so that it is tested without a GPU;
``CudaMemoryReader`` reads the real numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from services.types import EngineConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemorySnapshot:
    """Taken right after the profiling forward pass."""

    total_bytes: int
    """The device's memory."""
    free_bytes: int
    """Free on the device now (other processes' use is not free)."""
    torch_peak_bytes: int
    """Peak allocated by torch during the profile: weights + the worst step's activations."""
    torch_reserved_bytes: int
    """Held by torch's caching allocator now (allocated or cached)."""

    @property
    def non_torch_bytes(self) -> int:
        """In use on the device but not through torch's allocator: CUDA context, cuBLAS and
        Triton workspaces, other processes."""
        return max(0, self.total_bytes - self.free_bytes - self.torch_reserved_bytes)


def kv_cache_budget(snapshot: MemorySnapshot, gpu_memory_utilization: float) -> int:
    """Bytes for the KV cache: ``utilization x total`` minus the profiled peak and the memory
    outside torch. Raises EngineConfigError (naming the setting) when nothing is left."""
    allowed = int(snapshot.total_bytes * gpu_memory_utilization)
    budget = allowed - snapshot.torch_peak_bytes - snapshot.non_torch_bytes
    if budget <= 0:
        raise EngineConfigError(
            f"gpu_memory_utilization={gpu_memory_utilization} allows {allowed / 2**30:.2f} GiB, "
            f"but the model's peak step needs {snapshot.torch_peak_bytes / 2**30:.2f} GiB and "
            f"{snapshot.non_torch_bytes / 2**30:.2f} GiB are used outside torch: no room for "
            "a KV cache (raise gpu_memory_utilization or lower max_num_batched_tokens)"
        )
    return budget


def check_kv_cache_fits(kv_cache_memory: int, snapshot: MemorySnapshot) -> None:
    """An explicit ``kv_cache_memory`` must fit in the device's free memory, read after the
    weights are loaded: else an EngineConfigError naming the setting at start-up, not an
    out-of-memory error from the allocation (other processes may hold most of the device)."""
    if kv_cache_memory > snapshot.free_bytes:
        raise EngineConfigError(
            f"kv_cache_memory={kv_cache_memory / 2**30:.2f} GiB does not fit: the device has "
            f"{snapshot.free_bytes / 2**30:.2f} GiB free of {snapshot.total_bytes / 2**30:.2f} "
            "GiB (the weights and other processes hold the rest); lower kv_cache_memory, or "
            "leave it unset to size the cache from gpu_memory_utilization"
        )


class MemoryReader(Protocol):
    def reset_peak(self) -> None: ...

    def snapshot(self) -> MemorySnapshot: ...


class CudaMemoryReader:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def snapshot(self) -> MemorySnapshot:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(
            total_bytes=total,
            free_bytes=free,
            torch_peak_bytes=torch.cuda.max_memory_allocated(self.device),
            torch_reserved_bytes=torch.cuda.memory_reserved(self.device),
        )
