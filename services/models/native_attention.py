"""Paged decode and prefill attention as C++ CPU kernels that read K/V straight out of the cache
blocks.

Why: the torch path's decode (``TorchPagedAttention._decode``) copies every request's blocks
into a padded ``[num_decodes, max_len, ...]`` tensor with ``index_select`` and runs masked SDPA
over the copy. The kernel (``csrc/paged_attention.cpp``) walks each block table in place,
widens every K/V row once for its whole GQA group, accumulates in fp32 and splits the batch over
torch's OpenMP threads. ``benchmarks/attention_kernels.py`` (bf16, 12 query / 4 KV heads x 64,
block 16; 2-core AMD EPYC with AVX-512, 2 threads; ms per layer call, best of several runs on a
shared machine, so torch's figures vary by up to 2x):

    num_seqs x context     1 x 256    16 x 512    64 x 320    64 x 1024
    torch                  0.06       1.6-4.9     3.9-6.1     32-44
    native                 0.012      0.19-0.29   0.71-0.85   3.8-4.4

The query (and output) and the cache each hold float32 or bfloat16, independently: a bf16
cache under fp32 compute (``kv_cache_dtype`` auto on CPU) is widened row by row like a bf16
one, so decode reads half the bytes of an fp32 cache.

End to end on the 12-layer small model (64 requests, 256-token prompts, bf16), a decode step
takes ~45 ms instead of ~88 ms. In float32 the greedy tokens are those of the torch path. On
the 2-core Intel host with AMX (bf16, 64 x 280, one layer in isolation) it takes 1.91 ms on one
thread and 0.96 ms on two, whichever variant: 9.6 and 19 GB/s, so what bounds it there is how
fast one core streams scattered blocks, not arithmetic. On the AMD EPYC (Zen 4) the kernel's
prefetches into the L1 were the limit: asked into the L2 instead, a layer call in the engine
(64 x ~270, bf16) took 0.8 ms instead of 1.2 (``docs/benchmarks.md``, twelfth pass).

Prefill chunks have a native kernel too (``csrc/prefill_attention.cpp``): every chunk of a step
in one call, its queries read in place from the flat batch (a view of the QKV projection) and
its keys from the cache, as a flash-attention loop that skips the key blocks above the diagonal
and writes straight into the chunk's output rows: no padding, gathers or copies. It is one of the
backend's ``prefill_kernels``, timed against the torch path's at start-up
(``prefill_kernel_choice.py``). On a CPU with AMX its bf16 products run on the tiles too (the
``amx`` variant), as torch's flash kernel's do.

The step's new K/V go into the cache in one native pass as well (``write_cache``:
``write_kv_cache`` of ``csrc/fused_ops.cpp``, the strided K/V rows of the QKV output rounded
straight into their slots, where the torch path converts them and runs two ``index_copy_``).

The kernels are one of the native CPU kernels (``native_build.py``: built on first use, one
variant per instruction set, chosen by the CPU's flags or ``PDSERVE_NATIVE_ISA``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.models.amx_linear import amx_unavailable_reason
from services.models.attention import (
    PADDED_KERNELS,
    AttentionMetadata,
    PrefillSpan,
    TorchPagedAttention,
    stack_block_tables,
)
from services.models.native_build import native_kernel_error, resolve_isa

logger = logging.getLogger(__name__)

NATIVE_PREFILL = "native"
"""The native backend's own prefill kernel, beside the torch path's ``PADDED_KERNELS``."""


@dataclass(frozen=True)
class PrefillChunks:
    """A step's prefill chunks as ``paged_prefill_attention`` takes them: built once per step
    (``prepare``), shared by every layer."""

    block_tables: torch.Tensor
    """[num_chunks, max_blocks] int64, padded with block 0 (never read)."""
    query_starts: torch.Tensor
    """[num_chunks] int64: the flat batch row of each chunk's first query."""
    query_lens: torch.Tensor
    """[num_chunks] int64."""
    start_positions: torch.Tensor
    """[num_chunks] int64: tokens in the cache before each chunk."""

    @staticmethod
    def build(spans: list[PrefillSpan]) -> PrefillChunks:
        device = spans[0].block_ids.device

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return PrefillChunks(
            block_tables=stack_block_tables(spans),
            query_starts=column([s.token_start for s in spans]),
            query_lens=column([s.num_tokens for s in spans]),
            start_positions=column([s.start_position for s in spans]),
        )


class NativePagedAttention(TorchPagedAttention):
    """``TorchPagedAttention`` with decodes on the native kernel, and prefill chunks too when
    ``prefill_kernel`` is ``native`` (the default; start-up timing may pick a torch one)."""

    prefill_kernels = (*PADDED_KERNELS, NATIVE_PREFILL)

    def __init__(self, block_size: int, scale: float, isa: str | None = None) -> None:
        super().__init__(block_size, scale)
        self.isa = resolve_isa(isa)
        """The kernel variant this backend runs (see ``resolve_isa``)."""
        error = native_kernel_error()
        if error is not None:
            raise RuntimeError(f"native paged attention is unavailable: {error}")
        self.prefill_kernel = NATIVE_PREFILL
        self.prefill_isa = self.isa
        """The prefill kernel's variant: ``amx`` (its bf16 products on the AMX tiles) where the
        best variant is avx512_bf16 and the CPU has AMX, unless ``PDSERVE_AMX=0``."""
        if self.isa == "avx512_bf16" and amx_unavailable_reason() is None:
            self.prefill_isa = "amx"
        self._chunks: PrefillChunks | None = None
        """The step's chunks when ``prefill_kernel`` is native; with ``_padded_metadata``."""
        logger.debug("native paged attention: %s kernel, prefill %s", self.isa, self.prefill_isa)

    def prepare(self, metadata: AttentionMetadata) -> None:
        super().prepare(metadata)
        native = self.prefill_kernel == NATIVE_PREFILL and bool(metadata.prefills)
        self._chunks = PrefillChunks.build(metadata.prefills) if native else None

    def write_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One native pass (``write_kv_cache``: the bits of the base class's conversion and
        ``index_copy_``, without the converted copies). The rounded K/V are made only for a
        torch prefill kernel, which reads them; the native one reads the cache."""
        torch.ops.pdserve.write_kv_cache(
            key_cache, value_cache, key, value, metadata.slot_mapping, self.isa
        )
        native_prefill = self.prefill_kernel == NATIVE_PREFILL and self.softcap is None
        if native_prefill or not metadata.prefills:
            return key, value
        return key.to(key_cache.dtype), value.to(value_cache.dtype)

    def attend_prefills(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        if not metadata.prefills:
            return
        if self.prefill_kernel != NATIVE_PREFILL:
            super().attend_prefills(query, key, value, key_cache, value_cache, metadata, output)
            return
        chunks = self._chunks if self._padded_metadata is metadata else None
        if chunks is None:  # no prepare for this step (a caller driving the model directly)
            chunks = PrefillChunks.build(metadata.prefills)
        torch.ops.pdserve.paged_prefill_attention(
            output,
            query,
            key_cache,
            value_cache,
            chunks.block_tables,
            chunks.query_starts,
            chunks.query_lens,
            chunks.start_positions,
            self.scale,
            self.prefill_isa,
        )

    def _decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        if self.softcap is not None:  # Gemma 2's soft-capped scores: the torch path's
            return super()._decode(query, key_cache, value_cache, metadata, window)
        # query, output: [num_decodes, num_heads, head_dim]. The kernel reads query in place when
        # each row's heads are contiguous, as in a view of the fused QKV output (the copy it
        # saves took ~4 us a layer at 64 sequences).
        num_heads, head_dim = query.shape[1], query.shape[2]
        if (
            query.stride(2) != 1
            or query.stride(1) != head_dim
            or query.stride(0) < num_heads * head_dim
        ):
            query = query.contiguous()
        output = query.new_empty(query.shape)
        torch.ops.pdserve.paged_decode_attention(
            output,
            query,
            key_cache,
            value_cache,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            self.scale,
            self.isa,
            window or 0,  # a sliding-window layer's (Gemma 3's): its last `window` tokens
        )
        return output
