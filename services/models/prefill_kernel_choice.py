"""Which implementation runs a step's padded prefill attention on this host: timed, not assumed.

Why: the two ways to attend over a batch of padded prefill chunks trade places between hosts.
Eight 256-token chunks of the ``small`` model (12 heads / 4 KV heads x 64, bf16, one layer):

    host                                   sdpa (torch's flash kernel)   matmul (fp32 softmax)
    2-core AMD EPYC, AVX-512, no AMX       17.6 ms                       10 ms
    2-core Intel Xeon with AMX             4.3 ms                        10.1 ms

With AMX the flash kernel's tiles run on the matrix unit while the explicit path's fp32
softmax over [chunks, heads, tokens, context] is slow elementwise work; without AMX the flash
kernel's small tiles lose to two large matmuls.

Life cycle, once per engine start, CPU only: after the model is loaded, ``choose_padded_kernel``
times one call of each kernel on a synthetic step of the model's head shapes (``num_chunks`` x
``chunk_tokens``), alternating so that load from other processes falls on both, keeps each one's
best of ``repeats``, sets the backend's ``padded_kernel`` to the faster and returns the timings
for the log. About 0.1-0.5 s; cheaper to measure than to cache. A GPU keeps ``sdpa``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.models.attention import (
    PADDED_KERNELS,
    PaddedPrefill,
    PrefillSpan,
    TorchPagedAttention,
)

KernelTimer = Callable[[str], float]
"""Seconds one padded prefill call takes with the named kernel; injected by tests."""


@dataclass(frozen=True)
class PaddedKernelChoice:
    kernel: str
    seconds: dict[str, float]
    """Best call per kernel, seconds; empty when nothing was timed."""

    def describe(self) -> str:
        if not self.seconds:
            return self.kernel
        times = ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in self.seconds.items())
        return f"{self.kernel} ({times} a layer)"


def padded_kernel_timer(
    backend: TorchPagedAttention,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_chunks: int = 8,
    chunk_tokens: int = 256,
) -> KernelTimer:
    """Times ``backend.attend_padded`` on ``num_chunks`` fresh chunks of ``chunk_tokens`` tokens
    with random queries (``dtype``) and a random cache (``cache_dtype``) of exactly their
    blocks."""
    block_size = backend.block_size
    blocks_per_chunk = -(-chunk_tokens // block_size)
    generator = torch.Generator().manual_seed(0)
    # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], one chunk's blocks in a row.
    cache = torch.randn(
        2, num_chunks * blocks_per_chunk, block_size, num_kv_heads, head_dim, generator=generator
    ).to(cache_dtype)
    query = torch.randn(num_chunks * chunk_tokens, num_heads, head_dim, generator=generator)
    query = query.to(dtype)
    spans = [
        PrefillSpan(
            token_start=c * chunk_tokens,
            num_tokens=chunk_tokens,
            start_position=0,
            block_ids=torch.arange(c * blocks_per_chunk, (c + 1) * blocks_per_chunk),
        )
        for c in range(num_chunks)
    ]
    padded = PaddedPrefill.build(spans, block_size)
    assert padded is not None  # equal chunks always batch

    def time_call(kernel: str) -> float:
        start = time.perf_counter()
        backend.attend_padded(query, cache[0], cache[1], padded, kernel=kernel)
        return time.perf_counter() - start

    return time_call


def choose_padded_kernel(
    backend: TorchPagedAttention,
    device: torch.device,
    time_call: KernelTimer,
    *,
    repeats: int = 3,
) -> PaddedKernelChoice:
    """Sets ``backend.padded_kernel`` to the faster kernel on this CPU (see the module's life
    cycle) and returns the choice; on other devices keeps ``sdpa`` and times nothing."""
    if device.type != "cpu":
        backend.padded_kernel = "sdpa"
        return PaddedKernelChoice("sdpa", {})
    for kernel in PADDED_KERNELS:
        time_call(kernel)  # warm-up: first-call allocations and oneDNN's kernel selection
    best = dict.fromkeys(PADDED_KERNELS, float("inf"))
    for _ in range(repeats):
        for kernel in PADDED_KERNELS:
            best[kernel] = min(best[kernel], time_call(kernel))
    # A tie keeps sdpa: it never materialises the scores.
    kernel = min(PADDED_KERNELS, key=lambda name: (best[name], name != "sdpa"))
    backend.padded_kernel = kernel
    return PaddedKernelChoice(kernel, best)
