"""Paged attention: the interface the model calls, and the portable torch implementation.

The KV cache of one layer is one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 keys, 1 values). A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Each step's flattened batch puts the decode tokens (one per request) first, then the prefill
chunks one after the other; ``AttentionMetadata`` describes both groups. A GPU kernel implements
the same ``AttentionBackend`` over the same metadata.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillSpan:
    """One request's chunk of prompt tokens in the flattened batch."""

    token_start: int
    """Index of the chunk's first token in the flattened batch."""
    num_tokens: int
    start_position: int
    """Tokens already in the cache before this chunk (prefix hits, earlier chunks)."""
    block_ids: torch.Tensor
    """[num_blocks covering start_position + num_tokens] int64."""

    @property
    def context_len(self) -> int:
        return self.start_position + self.num_tokens


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64: the cache slot each new token's K and V are written to."""
    num_decodes: int
    """The first ``num_decodes`` tokens are single-token decodes, one request each."""
    decode_block_tables: torch.Tensor
    """[num_decodes, max_blocks] int64, padded with block 0 (masked out)."""
    decode_seq_lens: torch.Tensor
    """[num_decodes] int64: context length of each decode, including its new token."""
    prefills: list[PrefillSpan]


class AttentionBackend(ABC):
    """Writes the step's new K/V into the paged cache and attends over each request's context."""

    def __init__(self, block_size: int, scale: float) -> None:
        self.block_size = block_size
        self.scale = scale

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads,
        head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim]."""


class TorchPagedAttention(AttentionBackend):
    """Portable path: gathers each context from its blocks, then ``scaled_dot_product_attention``.

    Decodes are batched into one call by padding contexts to the longest and masking; the GQA
    group is folded into the query-length axis so that K/V are never repeated per query head.
    Prefill chunks run one call each (a step holds few of them, and padding a 2k-token chunk to
    the batch would cost far more than the calls).
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # Write first: a chunk attends to its own new tokens through the cache.
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)

        output = torch.empty_like(query)
        if metadata.num_decodes:
            num = metadata.num_decodes
            output[:num] = self._decode(query[:num], key_cache, value_cache, metadata)
        for span in metadata.prefills:
            end = span.token_start + span.num_tokens
            output[span.token_start : end] = self._prefill(
                query[span.token_start : end],
                key[span.token_start : end],
                value[span.token_start : end],
                key_cache,
                value_cache,
                span,
            )
        return output

    def _decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_decodes, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[2]
        block_tables = metadata.decode_block_tables
        max_len = block_tables.shape[1] * self.block_size
        # keys, values: [num_decodes, num_kv_heads, max_len, head_dim]. index_select over the
        # flattened table copies whole blocks; advanced indexing is ~2.5x slower here.
        flat_ids = block_tables.view(-1)
        keys = key_cache.index_select(0, flat_ids).view(
            num_decodes, max_len, num_kv_heads, head_dim
        )
        values = value_cache.index_select(0, flat_ids).view(
            num_decodes, max_len, num_kv_heads, head_dim
        )
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        # mask: [num_decodes, 1, 1, max_len], True where a real context token sits.
        positions = torch.arange(max_len, device=query.device)
        mask = (positions[None, :] < metadata.decode_seq_lens[:, None])[:, None, None, :]
        # q: [num_decodes, num_kv_heads, queries_per_kv, head_dim]
        q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        return out.reshape(num_decodes, num_heads, head_dim)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        span: PrefillSpan,
    ) -> torch.Tensor:
        # q: [num_heads, num_tokens, head_dim]
        q = query.transpose(0, 1)
        if span.start_position == 0:
            # Nothing cached before the chunk: attend to the fresh K/V with a causal mask.
            out = F.scaled_dot_product_attention(
                q,
                key.transpose(0, 1),
                value.transpose(0, 1),
                is_causal=True,
                scale=self.scale,
                enable_gqa=True,
            )
            return out.transpose(0, 1)
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        context_len = span.context_len
        # keys, values: [num_kv_heads, context_len, head_dim]
        keys = key_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)
        values = value_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)
        keys, values = keys[:context_len], values[:context_len]
        # mask: [num_tokens, context_len]; query i sits at position start_position + i.
        query_positions = torch.arange(span.num_tokens, device=q.device) + span.start_position
        mask = torch.arange(context_len, device=q.device)[None, :] <= query_positions[:, None]
        out = F.scaled_dot_product_attention(
            q,
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)


def make_attention_backend(
    name: str, device: torch.device, *, block_size: int, scale: float
) -> AttentionBackend:
    """``torch``, ``native`` (raises if the CPU kernel cannot be built) or ``auto``."""
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return TorchPagedAttention(block_size, scale)
    try:
        from services.models.native_attention import NativePagedAttention, native_kernel_error
    except ImportError as exc:
        error: str | None = f"cannot import the native backend: {exc}"
    else:
        error = native_kernel_error()
        if error is None and device.type == "cpu":
            return NativePagedAttention(block_size, scale)
    if name == "native":
        raise ValueError(f"attention_backend 'native' is unavailable: {error or 'CPU only'}")
    logger.warning("native CPU attention unavailable (%s); using the torch path", error)
    return TorchPagedAttention(block_size, scale)
