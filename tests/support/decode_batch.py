"""Random paged decode batches for the attention backends' tests (``tests/models/``)."""

from __future__ import annotations

import torch

from services.models.attention import AttentionMetadata, TorchPagedAttention

# Lengths around block boundaries for block sizes 4 and 16, a single token, and contexts that
# span many tiles.
SEQ_LENS = [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 47, 64, 100, 257]


def make_decode_batch(
    seq_lens: list[int],
    *,
    num_kv_heads: int = 3,
    group: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """query [num_seqs, heads, dim] and kv_cache [2, blocks, block, kv_heads, dim], random; the
    sequences' blocks scattered over a cache three times their size, block tables padded with
    random valid ids."""
    gen = torch.Generator().manual_seed(seed)
    num_used = [-(-n // block_size) for n in seq_lens]
    num_blocks = 3 * sum(num_used) + 5
    max_blocks = max(num_used) + 2
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    # Every entry a valid id (the torch path reads padding too), past the end random.
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen)
    distinct = torch.randperm(num_blocks, generator=gen).tolist()
    for i, n in enumerate(num_used):
        tables[i, :n] = torch.tensor(distinct[:n])
        distinct = distinct[n:]
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        num_decodes=len(seq_lens),
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        prefills=[],
    )
    return query.to(dtype), kv_cache.to(dtype), metadata


def decode(
    backend: TorchPagedAttention, query: torch.Tensor, kv_cache: torch.Tensor, metadata
) -> torch.Tensor:
    return backend._decode(query, kv_cache[0], kv_cache[1], metadata)
