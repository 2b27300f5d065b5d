"""Paged attention as Triton kernels that read K/V straight out of the cache blocks (GPU path).

Same ``AttentionBackend`` over the same ``AttentionMetadata`` as ``TorchPagedAttention``, which
is its reference. Four kernels:

- ``_write_kv_kernel``: one program per (token, KV head) copies the step's K and V rows into
  their cache slots (one launch where ``index_copy_`` took one for each).
- ``_decode_partial_kernel``: one program per (decode, KV head, split). The GQA group's query
  heads are rows of one ``tl.dot`` (padded to 16 rows, the MMA minimum), so each K/V row is read
  once for the whole group. Long contexts are split into partitions (flash-decoding) so that a
  small batch still fills the GPU; each split writes an unnormalised partial output, its running
  max and its softmax denominator.
- ``_decode_reduce_kernel``: one program per (decode, query head) merges the splits.
- ``_prefill_kernel``: one program per (chunk, query head, block of ``BLOCK_M`` queries), causal
  over the chunk's cached prefix and its own tokens (all read back from the cache, where
  ``forward`` writes the step's new K/V first), variable length per chunk.

Every shape the host passes is derived from the metadata without reading device memory, so a
decode step issues no device-to-host sync and can be captured in a CUDA graph (the split count
depends only on the batch size and the block-table width, both fixed per graph bucket).

Testing without a GPU: under ``TRITON_INTERPRET=1`` (set before this module is imported) the
kernels run on CPU tensors. The interpreter mis-computes ``tl.dot`` on bf16, so there every dot
is done in float32 (``UPCAST``); on a GPU fp16/bf16 go to the tensor cores as they are.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.models.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Decode splits a context until about this many programs run (an H100 has 132 SMs); the
# interpreter runs programs one by one in Python, so there only a few.
_TARGET_DECODE_PROGRAMS = 8 if INTERPRET else 512
_MIN_MMA = 16
_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    k_cache_ptr,  # [num_slots, num_kv_heads, head_dim]
    v_cache_ptr,
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], rows strided (a view of the QKV output)
    v_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_slot,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (token, KV head): its K and V rows into slot ``slot_mapping[token]``, as they are
    (the cache holds the compute dtype on CUDA)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < HEAD_DIM
    slot = tl.load(slot_mapping_ptr + token)
    k = tl.load(k_ptr + token * stride_k_tok + head * stride_k_head + cols, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + head * stride_v_head + cols, mask=mask)
    dst = slot * stride_cache_slot + head * stride_cache_head + cols
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key_cache[slot_mapping[t]] = key[t] (and V), the caches [num_blocks, block_size,
    num_kv_heads, head_dim] in key's dtype, key and value [num_tokens, num_kv_heads, head_dim]
    with unit stride over head_dim."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1
    assert key_cache.dtype == key.dtype == value.dtype == value_cache.dtype
    k_flat = key_cache.view(-1, num_kv_heads, head_dim)
    v_flat = value_cache.view(-1, num_kv_heads, head_dim)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k_flat,
        v_flat,
        key,
        value,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _decode_partial_kernel(
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, BLOCK_D] float32, unnormalised
    part_max_ptr,  # [num_seqs, num_heads, num_splits] float32, running max (log2 domain)
    part_sum_ptr,  # [num_seqs, num_heads, num_splits] float32, softmax denominator
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_slots, num_kv_heads, head_dim] (a layer's key cache, flattened)
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int64
    seq_lens_ptr,  # [num_seqs] int64
    scale_log2,  # softmax scale * log2(e)
    stride_q_tok,
    stride_q_head,
    stride_kv_slot,
    stride_kv_head,
    stride_bt,
    num_heads,
    num_splits,
    partition_size,  # tokens per split, a multiple of BLOCK_N
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    # q: [GROUP_PAD, BLOCK_D], padding rows zero
    q = tl.load(
        q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for token0 in range(start, end, BLOCK_N):
        tokens = token0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        pages = tl.load(table + tokens // BLOCK_SIZE, mask=token_mask, other=0)
        slots = pages * BLOCK_SIZE + tokens % BLOCK_SIZE
        kv_offsets = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        # k, v: [BLOCK_N, BLOCK_D]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # scores: [GROUP_PAD, BLOCK_N] in the log2 domain
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        alpha = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(probs, 1)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max

    # An empty split (start >= seq_len) stores max -inf, sum 0, acc 0: the reduce weighs it 0.
    part = (seq * num_heads + heads) * num_splits + split
    tl.store(part_max_ptr + part, running_max, mask=row_mask)
    tl.store(part_sum_ptr + part, running_sum, mask=row_mask)
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_out_tok,
    stride_out_head,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    base = (seq * num_heads + head) * num_splits
    global_max = tl.full([], float("-inf"), dtype=tl.float32)
    for split in range(0, num_splits):
        global_max = tl.maximum(global_max, tl.load(part_max_ptr + base + split))
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(0, num_splits):
        weight = tl.exp2(tl.load(part_max_ptr + base + split) - global_max)
        total += weight * tl.load(part_sum_ptr + base + split)
        acc += weight * tl.load(part_acc_ptr + (base + split) * BLOCK_D + dims)
    out = acc / total
    tl.store(
        out_ptr + seq * stride_out_tok + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@triton.jit
def _prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_slots, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_chunks, max_blocks] int64
    chunk_token_starts_ptr,  # [num_chunks] int64: row of the chunk's first token
    chunk_num_tokens_ptr,  # [num_chunks] int64
    chunk_start_positions_ptr,  # [num_chunks] int64: tokens cached before the chunk
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_out_tok,
    stride_out_head,
    stride_kv_slot,
    stride_kv_head,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    query_block = tl.program_id(2)
    num_tokens = tl.load(chunk_num_tokens_ptr + chunk)
    if query_block * BLOCK_M >= num_tokens:
        return
    token_start = tl.load(chunk_token_starts_ptr + chunk)
    start_position = tl.load(chunk_start_positions_ptr + chunk)
    kv_head = head // GROUP

    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_tokens
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_rows = (token_start + rows).to(tl.int64)
    # q: [BLOCK_M, BLOCK_D]; query i sits at position start_position + i
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    query_positions = start_position + rows
    # Keys up to the block's last real query: its cached prefix and its own causal past.
    kv_end = start_position + tl.minimum((query_block + 1) * BLOCK_M, num_tokens)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + chunk.to(tl.int64) * stride_bt
    for token0 in range(0, kv_end, BLOCK_N):
        tokens = token0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < kv_end
        pages = tl.load(table + tokens // BLOCK_SIZE, mask=token_mask, other=0)
        slots = pages * BLOCK_SIZE + tokens % BLOCK_SIZE
        kv_offsets = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # scores: [BLOCK_M, BLOCK_N]; key 0 is visible to every row, so no row is all -inf
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = token_mask[None, :] & (tokens[None, :] <= query_positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        alpha = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(probs, 1)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_out_tok + head * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of one (head size, dtype): chosen so that ``ptxas`` reports no register
    spills on sm_90 with Triton 3.7.1 and 3.6.0 (``services/models/triton_compile.py`` checks
    every variant)."""

    decode_block_n: int
    """Tokens per inner iteration of the decode loop; a split's partition is a multiple."""
    decode_num_warps: int
    prefill_block_m: int
    """Queries per prefill program."""
    prefill_block_n: int
    prefill_num_warps: int


def tile_config(head_dim: int, dtype: torch.dtype) -> TileConfig:
    # Bytes of one padded K/V row: registers per thread grow with tile rows x this.
    row_bytes = max(_MIN_MMA, triton.next_power_of_2(head_dim)) * dtype.itemsize
    if row_bytes <= 128:
        return TileConfig(
            decode_block_n=64,
            decode_num_warps=4,
            prefill_block_m=32,
            prefill_block_n=32,
            prefill_num_warps=4,
        )
    if row_bytes <= 256:
        return TileConfig(
            decode_block_n=32,
            decode_num_warps=4,
            prefill_block_m=32,
            prefill_block_n=32,
            prefill_num_warps=8,
        )
    return TileConfig(
        decode_block_n=16,
        decode_num_warps=8,
        prefill_block_m=16,
        prefill_block_n=16,
        prefill_num_warps=8,
    )


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact IEEE dots (the default tf32 would break parity with the reference).
    return "ieee" if INTERPRET or dtype == torch.float32 else "tf32"


def decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_len: int, block_n: int
) -> tuple[int, int]:
    """(num_splits, partition_size) for a decode batch; host arithmetic only (graph-safe)."""
    max_iters = max(1, triton.cdiv(max_len, block_n))
    wanted = triton.cdiv(_TARGET_DECODE_PROGRAMS, max(1, num_seqs * num_kv_heads))
    num_splits = max(1, min(wanted, max_iters))
    partition = triton.cdiv(max_iters, num_splits) * block_n
    return triton.cdiv(max(max_len, 1), partition), partition


def paged_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Writes ``out[i]`` = attention of ``query[i]`` over decode i's context (in place).

    out, query: [num_seqs, num_heads, head_dim]; key_cache, value_cache: [num_blocks,
    block_size, num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks] int64;
    seq_lens: [num_seqs] int64, each in [1, max_blocks * block_size].
    """
    num_seqs, num_heads, head_dim = query.shape
    assert out.shape == query.shape and block_tables.shape[0] == seq_lens.shape[0] == num_seqs
    if num_seqs == 0:
        return
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    block_d = max(_MIN_MMA, triton.next_power_of_2(head_dim))
    tiles = tile_config(head_dim, query.dtype)
    num_splits, partition = decode_num_splits(
        num_seqs, num_kv_heads, block_tables.shape[1] * block_size, tiles.decode_block_n
    )
    part_acc = torch.empty(
        num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device
    )
    part_max = torch.empty(
        num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device
    )
    part_sum = torch.empty_like(part_max)
    k_flat = key_cache.view(-1, num_kv_heads, head_dim)
    v_flat = value_cache.view(-1, num_kv_heads, head_dim)
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        part_acc,
        part_max,
        part_sum,
        query,
        k_flat,
        v_flat,
        block_tables,
        seq_lens,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        block_tables.stride(0),
        num_heads,
        num_splits,
        partition,
        GROUP=group,
        GROUP_PAD=max(_MIN_MMA, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=tiles.decode_block_n,
        BLOCK_SIZE=block_size,
        UPCAST=INTERPRET,
        PRECISION=_precision(query.dtype),
        num_warps=tiles.decode_num_warps,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        out,
        part_acc,
        part_max,
        part_sum,
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
    )


def paged_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_starts: torch.Tensor,
    num_tokens: torch.Tensor,
    start_positions: torch.Tensor,
    max_num_tokens: int,
    scale: float,
) -> None:
    """Causal attention of every prefill chunk over its cached prefix and itself (in place).

    out, query: [num_flat_tokens, num_heads, head_dim] (rows outside the chunks untouched);
    block_tables: [num_chunks, max_blocks] int64; token_starts, num_tokens, start_positions:
    [num_chunks] int64; max_num_tokens: host-side max of num_tokens (sizes the grid).
    """
    num_chunks = block_tables.shape[0]
    if num_chunks == 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = key_cache.shape
    k_flat = key_cache.view(-1, num_kv_heads, head_dim)
    v_flat = value_cache.view(-1, num_kv_heads, head_dim)
    tiles = tile_config(head_dim, query.dtype)
    grid = (num_chunks, num_heads, triton.cdiv(max_num_tokens, tiles.prefill_block_m))
    _prefill_kernel[grid](
        out,
        query,
        k_flat,
        v_flat,
        block_tables,
        token_starts,
        num_tokens,
        start_positions,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(_MIN_MMA, triton.next_power_of_2(head_dim)),
        BLOCK_M=tiles.prefill_block_m,
        BLOCK_N=tiles.prefill_block_n,
        BLOCK_SIZE=block_size,
        UPCAST=INTERPRET,
        PRECISION=_precision(query.dtype),
        num_warps=tiles.prefill_num_warps,
    )


class _PrefillBatch:
    """The step's prefill chunks as device tensors, built once per step in ``prepare``."""

    def __init__(self, metadata: AttentionMetadata) -> None:
        spans = metadata.prefills
        assert spans, "a step without prefill chunks builds no _PrefillBatch"
        device = spans[0].block_ids.device
        self.num_chunks = len(spans)
        self.max_num_tokens = max((s.num_tokens for s in spans), default=0)
        # [num_chunks, max_blocks] int64, padded with block 0 (never read: keys stop at kv_end)
        self.block_tables = torch.nn.utils.rnn.pad_sequence(
            [s.block_ids for s in spans], batch_first=True
        )
        columns = [[s.token_start, s.num_tokens, s.start_position] for s in spans]
        # info: [3, num_chunks] int64, one host-to-device copy
        info = torch.tensor(columns, dtype=torch.int64).reshape(-1, 3).t().contiguous()
        self.token_starts, self.num_tokens, self.start_positions = info.to(device)


class TritonPagedAttention(AttentionBackend):
    """Decodes and prefill chunks on Triton kernels that walk the block tables in place."""

    reads_only_context_blocks = True

    def __init__(self, block_size: int, scale: float) -> None:
        super().__init__(block_size, scale)
        self._prefills: _PrefillBatch | None = None

    def prepare(self, metadata: AttentionMetadata) -> None:
        self._prefills = _PrefillBatch(metadata) if metadata.prefills else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        if window is not None:  # the engine refuses such a model with this backend first
            raise NotImplementedError("the Triton kernels attend to the whole context only")
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # Write first: a chunk attends to its own new tokens through the cache.
        write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
        # Both kernels take the query's token and head strides: a view of the fused QKV output
        # is read in place (a copy was one more kernel a layer in every graphed decode step).
        if query.stride(2) != 1:
            query = query.contiguous()
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.num_decodes:
            num = metadata.num_decodes
            paged_decode(
                output[:num],
                query[:num],
                key_cache,
                value_cache,
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
                self.scale,
            )
        batch = self._prefills
        if metadata.prefills:
            assert batch is not None, "prepare() was not called for this step"
            paged_prefill(
                output,
                query,
                key_cache,
                value_cache,
                batch.block_tables,
                batch.token_starts,
                batch.num_tokens,
                batch.start_positions,
                batch.max_num_tokens,
                self.scale,
            )
        return output


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None when the kernels can run on ``device``; else why not."""
    if device.type == "cuda":
        return None
    if device.type == "cpu" and INTERPRET:
        return None
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for tests), got {device}"
