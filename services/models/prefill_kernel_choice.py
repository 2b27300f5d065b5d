"""Which kernel runs a step's prefill attention on this host: timed, not assumed.

Why: the ways to attend a batch of prefill chunks trade places between hosts. Eight 256-token
chunks of the ``small`` model (12 heads / 4 KV heads x 64, bf16, one layer):

    host                                   sdpa (torch's flash kernel)   matmul (fp32 softmax)
    2-core AMD EPYC, AVX-512, no AMX       17.6 ms                       10 ms
    2-core Intel Xeon with AMX             4.3 ms                        10.1 ms

With AMX the flash kernel's tiles run on the matrix unit while the explicit path's fp32
softmax over [chunks, heads, tokens, context] is slow elementwise work; without AMX the flash
kernel's small tiles lose to two large matmuls. The native backend adds its own kernel
(``native``: fp32 vector arithmetic, no padding, causal blocks skipped), which wins where the
matrix unit does not carry torch's (figures in ``docs/benchmarks.md``).

Life cycle, once per engine start, CPU only: after the model is loaded, ``choose_prefill_kernel``
times one call of each of the backend's ``prefill_kernels`` on synthetic steps of the model's
head shapes (``STEPS``), alternating so that load from other processes falls on all of them,
keeps each one's best of ``repeats``, sets the backend's ``prefill_kernel`` to the fastest and
returns the timings for the log. 0.2-0.3 s at the small model's heads on the AMX host (bf16, and
fp32 with AMX off); cheaper to measure than to cache. A GPU keeps ``sdpa``.
``PDSERVE_PREFILL_KERNEL`` forces a kernel instead of timing (tests, benchmarks); one the backend
lacks is an error naming those it has.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.models.attention import AttentionMetadata, PrefillSpan, TorchPagedAttention
from services.types import EngineConfigError

KERNEL_ENV = "PDSERVE_PREFILL_KERNEL"
"""Forces the prefill attention kernel of every CPU engine of the process (no timing)."""

KernelTimer = Callable[[str], float]
"""Seconds one prefill attention call takes with the named kernel; injected by tests."""


@dataclass(frozen=True)
class PrefillKernelChoice:
    kernel: str
    seconds: dict[str, float]
    """Best call per kernel, seconds; empty when nothing was timed."""

    def describe(self) -> str:
        if not self.seconds:
            return self.kernel  # a GPU, or forced by KERNEL_ENV
        times = ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in self.seconds.items())
        return f"{self.kernel} ({times} a layer)"


STEPS = ((8, 256), (1, 1024))
"""The synthetic steps the kernels are timed on, (chunks, tokens each): short prompts batched
(the padded kernels' case) and one long prompt alone, which the torch path attends by itself.
A kernel's time is the sum of both: ranking by one shape can pick a kernel several times slower
on the other."""


def prefill_kernel_timer(
    backend: TorchPagedAttention,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    steps: Sequence[tuple[int, int]] = STEPS,
    outputs: dict[str, list[torch.Tensor]] | None = None,
) -> KernelTimer:
    """Times ``backend.attend_prefills`` on ``steps`` (each ``num_chunks`` fresh chunks of
    ``chunk_tokens`` tokens: random queries (``dtype``) and a random cache (``cache_dtype``) of
    exactly their blocks, as the engine's step would see them) and returns the sum. Each call's
    outputs, one per step, are kept in ``outputs`` under its kernel, when given (tests)."""
    calls = [
        _step_call(backend, num_heads, num_kv_heads, head_dim, dtype, cache_dtype, *step)
        for step in steps
    ]

    def time_call(kernel: str) -> float:
        backend.prefill_kernel = kernel
        seconds = 0.0
        results = []
        for call in calls:
            elapsed, output = call()
            seconds += elapsed
            results.append(output)
        if outputs is not None:
            outputs[kernel] = results
        return seconds

    return time_call


def _step_call(
    backend: TorchPagedAttention,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_chunks: int,
    chunk_tokens: int,
) -> Callable[[], tuple[float, torch.Tensor]]:
    """One synthetic step, and a call that attends it with the backend's current kernel:
    (seconds, output)."""
    block_size = backend.block_size
    blocks_per_chunk = -(-chunk_tokens // block_size)
    generator = torch.Generator().manual_seed(0)
    # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], one chunk's blocks in a row.
    cache = torch.randn(
        2, num_chunks * blocks_per_chunk, block_size, num_kv_heads, head_dim, generator=generator
    ).to(cache_dtype)
    num_tokens = num_chunks * chunk_tokens
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    spans = [
        PrefillSpan(
            token_start=c * chunk_tokens,
            num_tokens=chunk_tokens,
            start_position=0,
            block_ids=torch.arange(c * blocks_per_chunk, (c + 1) * blocks_per_chunk),
        )
        for c in range(num_chunks)
    ]
    # The chunks' own K/V as the step wrote them to the cache: the first chunk_tokens slots of
    # each chunk's blocks.
    slots = torch.cat(
        [torch.arange(chunk_tokens) + c * blocks_per_chunk * block_size for c in range(num_chunks)]
    )
    key, value = (cache[i].view(-1, num_kv_heads, head_dim)[slots] for i in (0, 1))
    metadata = AttentionMetadata(
        slot_mapping=slots,
        num_decodes=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int64),
        decode_seq_lens=torch.zeros(0, dtype=torch.int64),
        prefills=spans,
    )

    def call() -> tuple[float, torch.Tensor]:
        backend.prepare(metadata)  # once per step in the engine, not per layer: not timed
        output = torch.empty_like(query)
        start = time.perf_counter()
        backend.attend_prefills(query, key, value, cache[0], cache[1], metadata, output)
        return time.perf_counter() - start, output

    return call


def choose_prefill_kernel(
    backend: TorchPagedAttention,
    device: torch.device,
    time_call: KernelTimer,
    *,
    repeats: int = 3,
) -> PrefillKernelChoice:
    """Sets ``backend.prefill_kernel`` to the fastest of its ``prefill_kernels`` on this CPU (see
    the module's life cycle) and returns the choice; on other devices keeps ``sdpa`` and times
    nothing."""
    if device.type != "cpu":
        backend.prefill_kernel = "sdpa"
        return PrefillKernelChoice("sdpa", {})
    kernels = backend.prefill_kernels
    forced = os.environ.get(KERNEL_ENV)
    if forced:
        if forced not in kernels:
            raise EngineConfigError(
                f"{KERNEL_ENV}={forced!r}: this attention backend's prefill kernels are "
                f"{', '.join(kernels)}"
            )
        backend.prefill_kernel = forced
        return PrefillKernelChoice(forced, {})
    for kernel in kernels:
        time_call(kernel)  # warm-up: first-call allocations and oneDNN's kernel selection
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(repeats):
        for kernel in kernels:
            best[kernel] = min(best[kernel], time_call(kernel))
    # A tie keeps the first listed: sdpa, which never materialises the scores.
    kernel = min(kernels, key=lambda name: (best[name], kernels.index(name)))
    backend.prefill_kernel = kernel
    return PrefillKernelChoice(kernel, best)
