"""Random steps of prefill chunks over a paged cache, and their dense reference, for the
attention backends' tests (``tests/models/``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.models.attention import AttentionMetadata, PrefillSpan


@dataclass(frozen=True)
class PrefillStep:
    query: torch.Tensor
    """[num_tokens, kv_heads * group, head_dim]: every chunk's queries, one after the other."""
    key: torch.Tensor
    """[num_tokens, kv_heads, head_dim]: the chunks' new keys, not yet in the cache."""
    value: torch.Tensor
    kv_cache: torch.Tensor
    """[2, num_blocks, block_size, kv_heads, head_dim]: each cached prefix already written."""
    metadata: AttentionMetadata
    full_kv: list[tuple[torch.Tensor, torch.Tensor]]
    """Each request's whole keys and values [start + num_tokens, kv_heads, head_dim]."""


def build_prefill_step(
    chunks: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    seed: int = 0,
) -> PrefillStep:
    """chunks: (start_position, num_tokens) per request; blocks drawn at random from a cache
    of 64 or more. Everything float32: a test casts what it needs."""
    gen = torch.Generator().manual_seed(seed)
    needed = sum(-(-(start + n) // block_size) for start, n in chunks)
    num_blocks = max(64, 2 * needed)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    queries, keys, values, slots, spans, full_kv = [], [], [], [], [], []
    token_start = 0
    for start, num_tokens in chunks:
        context = start + num_tokens
        block_ids = [free_blocks.pop() for _ in range(-(-context // block_size))]
        k_all = torch.randn(context, num_kv_heads, head_dim, generator=gen)
        v_all = torch.randn(context, num_kv_heads, head_dim, generator=gen)
        # The cached prefix is already in the cache; the chunk's own K/V arrive with the step.
        for pos in range(start):
            block, offset = block_ids[pos // block_size], pos % block_size
            kv_cache[0, block, offset], kv_cache[1, block, offset] = k_all[pos], v_all[pos]
        slots += [
            block_ids[p // block_size] * block_size + p % block_size for p in range(start, context)
        ]
        queries.append(torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen))
        keys.append(k_all[start:])
        values.append(v_all[start:])
        spans.append(PrefillSpan(token_start, num_tokens, start, torch.tensor(block_ids)))
        full_kv.append((k_all, v_all))
        token_start += num_tokens
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int64),
        decode_seq_lens=torch.zeros(0, dtype=torch.int64),
        prefills=spans,
    )
    return PrefillStep(
        torch.cat(queries), torch.cat(keys), torch.cat(values), kv_cache, metadata, full_kv
    )


def dense_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
) -> torch.Tensor:
    """Causal attention of queries q [n, H, D] at positions start..start+n-1 over keys, values
    [start + n, Hkv, D] (query head h uses KV head h // (H // Hkv)), computed in float64 and
    returned in q's dtype."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[2])
    query_pos = torch.arange(q.shape[0])[:, None] + start
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
