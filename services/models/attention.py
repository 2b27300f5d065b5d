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


def stack_block_tables(spans: list[PrefillSpan]) -> torch.Tensor:
    """[len(spans), the longest table] int64: each span's block ids, padded with block 0."""
    max_blocks = max(s.block_ids.numel() for s in spans)
    device = spans[0].block_ids.device
    tables = torch.zeros(len(spans), max_blocks, dtype=torch.int64, device=device)
    for row, span in enumerate(spans):
        tables[row, : span.block_ids.numel()] = span.block_ids
    return tables


# Padding more than doubles the work past this (the batched call is about as fast as one call per
# chunk on its real work, so that is where it stops paying).
_MAX_PADDING_WASTE = 2.0
# The matmul kernel materialises [chunks, heads, tokens, context] float32 scores: above this it
# gives way to SDPA, which never does.
_MAX_PADDED_SCORE_BYTES = 64 << 20

PADDED_KERNELS = ("sdpa", "matmul")
"""How the torch path attends a step's padded prefill chunks (``TorchPagedAttention.
prefill_kernel``): ``sdpa``, one masked ``scaled_dot_product_attention`` call (torch's flash
kernel on the CPU), or ``matmul``, two batched matmuls around a float32 softmax. Which is faster
depends on the host (``prefill_kernel_choice.py`` times every kernel of the backend's
``prefill_kernels``); the results agree to rounding."""


@dataclass(frozen=True)
class PaddedPrefill:
    """Every prefill chunk of a step padded to ``max_tokens`` queries and ``max_context`` keys,
    attended in one batch (``PADDED_KERNELS``) instead of one call per chunk: about twice as fast
    on the AMD host of the first measurements (8 x 256-token chunks, 19 → 10 ms a layer)."""

    token_index: torch.Tensor
    """[num_chunks * max_tokens] int64: row of the flat batch for each padded query (padding
    repeats the chunk's first row)."""
    is_real: torch.Tensor
    """[num_chunks * max_tokens] bool: False for padding queries."""
    real_slots: torch.Tensor
    """[real tokens] int64: where the real queries sit in the padded batch (``is_real``'s
    indices), computed once per step rather than once per layer."""
    real_rows: torch.Tensor
    """[real tokens] int64: the flat batch's row of each of ``real_slots``."""
    contiguous_start: int | None
    """When the padded batch is exactly the flat rows ``[contiguous_start, contiguous_start +
    num_chunks * max_tokens)`` (every chunk full length, one after the other: the usual long
    prefill), queries and outputs are views of those rows, with no gather and no scatter."""
    block_tables: torch.Tensor
    """[num_chunks, max_blocks] int64, padded with block 0."""
    mask: torch.Tensor
    """[num_chunks, 1, max_tokens, max_blocks * block_size] bool: True where a query may attend
    (causal within the chunk, all of the cached context before it)."""
    aligned: bool
    """Slot i of every chunk holds the query at position i: a chunk's real queries sit at slots
    ``start_position .. context_len - 1`` and the slots of its cached part are padding. Query
    slot i then sees exactly keys 0..i, SDPA's own top-left causal mask, which lets its flash
    kernel skip the blocks above the diagonal (8 x 256 tokens, bf16: 3.65 against 4.52 ms a
    layer with the boolean mask). Keys past a chunk's end lie above the diagonal of every real
    query. Chosen when no chunk's context is longer than the longest chunk, so that it costs no
    more slots than packing each chunk's queries from slot 0: every fresh batch, and the usual
    step of a prompt queue (the rest of a prompt begun last step beside fresh chunks)."""
    all_fresh: bool
    """Every chunk starts at position 0 (nothing cached before it); such a batch is aligned."""

    @property
    def num_chunks(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_tokens(self) -> int:
        return self.mask.shape[2]

    @staticmethod
    def build(spans: list[PrefillSpan], block_size: int) -> PaddedPrefill | None:
        """None when there is nothing to batch or padding would waste too much work."""
        if len(spans) < 2:
            return None
        device = spans[0].block_ids.device
        max_tokens = max(s.num_tokens for s in spans)
        max_blocks = max(s.block_ids.numel() for s in spans)
        max_context = max_blocks * block_size
        real_work = sum(s.num_tokens * s.context_len for s in spans)
        if len(spans) * max_tokens * max_context > _MAX_PADDING_WASTE * real_work:
            return None
        aligned = max(s.context_len for s in spans) <= max_tokens
        offsets = torch.arange(max_tokens, device=device)
        starts = torch.tensor([s.token_start for s in spans], device=device)
        lengths = torch.tensor([s.num_tokens for s in spans], device=device)
        positions = torch.tensor([s.start_position for s in spans], device=device)
        # first_slot[c]: the slot of chunk c's first real query; rank: each slot's index among the
        # chunk's real queries.
        first_slot = positions if aligned else torch.zeros_like(positions)
        rank = offsets[None, :] - first_slot[:, None]  # [num_chunks, max_tokens]
        is_real = (rank >= 0) & (rank < lengths[:, None])
        token_index = starts[:, None] + torch.where(is_real, rank, 0)
        first = spans[0].token_start
        adjacent = all(
            s.num_tokens == max_tokens and s.token_start == first + i * max_tokens
            for i, s in enumerate(spans)
        )
        real_slots = is_real.reshape(-1).nonzero().squeeze(1)
        tables = stack_block_tables(spans)
        # The real query of rank i sits at position start_position + i and sees keys 0..that
        # position. Aligned, that is its slot, and every slot sees keys 0..slot (the
        # causal mask); else a padding query sees key 0 only, so its softmax stays finite.
        if aligned:
            query_positions = offsets[None, :].expand(len(spans), max_tokens)
        else:
            query_positions = torch.where(is_real, positions[:, None] + offsets[None, :], 0)
        keys = torch.arange(max_context, device=device)
        allowed = keys[None, None, :] <= query_positions[:, :, None]  # [chunks, tokens, context]
        return PaddedPrefill(
            token_index=token_index.reshape(-1),
            is_real=is_real.reshape(-1),
            real_slots=real_slots,
            real_rows=token_index.reshape(-1)[real_slots],
            contiguous_start=first if adjacent else None,
            block_tables=tables,
            mask=allowed[:, None],
            aligned=aligned,
            all_fresh=all(s.start_position == 0 for s in spans),
        )


class AttentionBackend(ABC):
    """Writes the step's new K/V into the paged cache and attends over each request's context."""

    reads_only_context_blocks: bool = False
    """True when decode cost follows each context's length, not the block table's width: then
    a fixed-width table (the static decode path's) costs nothing. The torch path gathers the
    whole width."""

    def __init__(self, block_size: int, scale: float) -> None:
        self.block_size = block_size
        self.scale = scale
        self.softcap: float | None = None
        """Gemma 2's attention soft-capping: each scaled score ``s`` becomes ``cap * tanh(s /
        cap)`` before the softmax. Set by the model (``LlamaModel``); only the torch path
        computes it (the native backend hands such a model's attention to it; the model runner
        refuses any other backend for it)."""

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Called once per step before the model runs: build what every layer will share."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads,
        head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim]. ``window``: a query at position p attends to
        the keys at positions (p - window, p] only (Gemma 3's sliding layers, transformers'
        rule); None: to every key up to p."""


class TorchPagedAttention(AttentionBackend):
    """Portable path: gathers each context from its blocks, then ``scaled_dot_product_attention``.

    Decodes are batched into one call by padding contexts to the longest and masking; the GQA
    group is folded into the query-length axis so that K/V are never repeated per query head.
    Prefill chunks of similar sizes are padded into one masked call (``PaddedPrefill``);
    otherwise each chunk runs one call, causal without a mask when nothing is cached before it.
    """

    prefill_kernels: tuple[str, ...] = PADDED_KERNELS
    """The ways this backend can attend a step's prefill chunks, for ``prefill_kernel``."""

    def __init__(self, block_size: int, scale: float) -> None:
        super().__init__(block_size, scale)
        self._padded: PaddedPrefill | None = None
        self._padded_metadata: AttentionMetadata | None = None
        """The step ``_padded`` was built for: a step whose ``prepare`` did not run (a caller
        driving the model directly) attends chunk by chunk, never with a stale batch."""
        self.prefill_kernel = "sdpa"
        """One of ``prefill_kernels``; ``prefill_kernel_choice`` sets the fastest on a CPU."""

    def prepare(self, metadata: AttentionMetadata) -> None:
        self._padded = (
            PaddedPrefill.build(metadata.prefills, self.block_size)
            if self.prefill_kernel in PADDED_KERNELS
            else None
        )
        self._padded_metadata = metadata

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # Write first: a chunk attends to its own new tokens through the cache.
        key, value = self.write_cache(key, value, key_cache, value_cache, metadata)

        if 0 < metadata.num_decodes == query.shape[0]:  # a decode step: no output to assemble
            return self._decode(query, key_cache, value_cache, metadata, window)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.num_decodes:
            num = metadata.num_decodes
            output[:num] = self._decode(query[:num], key_cache, value_cache, metadata, window)
        if window is not None or self.softcap is not None:
            self.attend_each_prefill(
                query, key, value, key_cache, value_cache, metadata, output, window
            )
        else:
            self.attend_prefills(query, key, value, key_cache, value_cache, metadata, output)
        return output

    def write_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the step's K/V ([num_tokens, num_kv_heads, head_dim]) into their slots and
        returns them as the prefill kernels read them: in the cache's dtype.

        The cache may hold a narrower dtype than the compute one (bf16 under fp32): K/V are
        rounded to it once, and a fresh chunk attends to the rounded values too, so that a
        token's output does not depend on whether its K/V came from the cache."""
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
        for cache, rows in ((key_cache, key), (value_cache, value)):
            slots = cache.view(-1, num_kv_heads, head_dim)
            if cache.dtype == torch.float8_e5m2:  # torch has no fp8 index_copy_: copy the bits
                slots, rows = slots.view(torch.uint8), rows.view(torch.uint8)
            slots.index_copy_(0, metadata.slot_mapping, rows)
        return key, value

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
        """Writes every prefill chunk's attention into its rows of ``output`` [num_tokens, heads,
        head_dim] with ``prefill_kernel``; the chunks' K/V (``key``, ``value``, in the cache's
        dtype) are already in the cache."""
        padded = self._padded if self._padded_metadata is metadata else None
        if padded is not None:
            out = self.attend_padded(query, key_cache, value_cache, padded, fresh_kv=(key, value))
            if padded.contiguous_start is not None:
                output[padded.contiguous_start : padded.contiguous_start + out.shape[0]] = out
            else:
                output.index_copy_(0, padded.real_rows, out.index_select(0, padded.real_slots))
            return
        self.attend_each_prefill(query, key, value, key_cache, value_cache, metadata, output)

    def attend_each_prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        output: torch.Tensor,
        window: int | None = None,
    ) -> None:
        """``attend_prefills`` one chunk at a time (``_prefill``): where no padded batch was
        built, and for a sliding-window layer (``window``: each query's mask holds its last
        ``window`` positions). key, value: the chunks' K/V as written to the cache."""
        for span in metadata.prefills:
            end = span.token_start + span.num_tokens
            output[span.token_start : end] = self._prefill(
                query[span.token_start : end],
                key[span.token_start : end],
                value[span.token_start : end],
                key_cache,
                value_cache,
                span,
                window,
            )

    def _decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        window: int | None = None,
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
        # Widened to the query's dtype (a no-op when the cache holds it): SDPA takes one dtype.
        keys, values = keys.transpose(1, 2).to(query.dtype), values.transpose(1, 2).to(query.dtype)
        # mask: [num_decodes, 1, 1, max_len], True where a real context token sits (within the
        # window where there is one: the query sits at seq_len - 1).
        positions = torch.arange(max_len, device=query.device)
        seq_lens = metadata.decode_seq_lens[:, None]
        mask = positions[None, :] < seq_lens
        if window is not None:
            mask &= positions[None, :] >= seq_lens - window
        mask = mask[:, None, None, :]
        # q: [num_decodes, num_kv_heads, queries_per_kv, head_dim]
        q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = self._attention(q, keys, values, mask)
        return out.reshape(num_decodes, num_heads, head_dim)

    def _attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """``scaled_dot_product_attention(q, keys, values)`` with ``self.scale``, GQA by
        broadcast: q [..., heads, queries, dim], keys and values [..., kv_heads, keys, dim],
        heads a multiple of kv_heads; ``mask`` True where a query may attend. With ``softcap``,
        the same products as transformers' eager Gemma 2 attention (the scores soft-capped
        before the mask; softmax in float32)."""
        if self.softcap is None:
            gqa = q.shape[-3] != keys.shape[-3]
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                enable_gqa=gqa,
            )  # fmt: skip
        group = q.shape[-3] // keys.shape[-3]
        if group > 1:
            keys = keys.repeat_interleave(group, dim=-3)
            values = values.repeat_interleave(group, dim=-3)
        # scores: [..., heads, queries, keys]
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if is_causal:
            queries, context = scores.shape[-2], scores.shape[-1]
            causal = torch.ones(queries, context, dtype=torch.bool, device=q.device).tril()
            mask = causal if mask is None else mask & causal
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values)

    def attend_padded(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        padded: PaddedPrefill,
        kernel: str | None = None,
        fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """All prefill chunks in one batch with ``kernel`` (default ``prefill_kernel``); returns
        [chunks * max_tokens, heads, head_dim]. query: [num_tokens, heads, head_dim];
        ``fresh_kv``: the step's new keys and values [num_tokens, kv_heads, head_dim], as written
        to the cache, read in place of the cache when every chunk is fresh and they are views of
        the flat batch (``contiguous_start``): the same values, without gathering blocks."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = key_cache.shape[2]
        chunks, tokens = padded.num_chunks, padded.max_tokens
        start = padded.contiguous_start
        # q: [chunks, tokens, heads, head_dim]
        if start is not None:
            q = query.narrow(0, start, chunks * tokens)
        else:
            q = query.index_select(0, padded.token_index)
        q = q.view(chunks, tokens, num_heads, head_dim)
        # keys, values: [chunks, context, kv_heads, head_dim], widened to the query's dtype.
        if fresh_kv is not None and padded.all_fresh and start is not None:
            # Each chunk's context is its own tokens.
            keys, values = (t.narrow(0, start, chunks * tokens) for t in fresh_kv)
            context = tokens
        else:
            # Read back from the cache (the chunks' own new tokens were written there first).
            context = padded.mask.shape[-1]
            flat_ids = padded.block_tables.view(-1)
            keys = key_cache.index_select(0, flat_ids)
            values = value_cache.index_select(0, flat_ids)
        keys = keys.view(chunks, context, num_kv_heads, head_dim).to(query.dtype)
        values = values.view(chunks, context, num_kv_heads, head_dim).to(query.dtype)
        kernel = kernel or self.prefill_kernel
        score_bytes = chunks * num_heads * tokens * context * 4
        if kernel == "matmul" and score_bytes <= _MAX_PADDED_SCORE_BYTES:
            mask = padded.mask[..., :context]
            out = self._padded_matmul(q, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=None if padded.aligned else padded.mask,
                is_causal=padded.aligned,
                scale=self.scale,
                enable_gqa=True,
            )
        # out: [chunks, heads, tokens, head_dim]
        return out.transpose(1, 2).reshape(chunks * tokens, num_heads, head_dim)

    def _padded_matmul(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q: [chunks, tokens, heads, dim]; keys, values: [chunks, context, kv_heads, dim];
        mask: [chunks, 1, tokens, context]. Returns [chunks, heads, tokens, dim]."""
        chunks, tokens, num_heads, head_dim = q.shape
        context, num_kv_heads = keys.shape[1], keys.shape[2]
        group = num_heads // num_kv_heads
        # q: [chunks, kv_heads, group * tokens, head_dim] (the GQA group folded into queries)
        q = q.view(chunks, tokens, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(chunks, num_kv_heads, group * tokens, head_dim)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        # scores: [chunks, kv_heads, group, tokens, context] in float32
        scores = torch.matmul(q, keys.transpose(-1, -2)).float()
        scores = scores.view(chunks, num_kv_heads, group, tokens, context).mul_(self.scale)
        scores.masked_fill_(~mask[:, :, None], float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype).view(chunks, num_kv_heads, -1, context)
        out = torch.matmul(probs, values).view(chunks, num_kv_heads, group, tokens, head_dim)
        return out.reshape(chunks, num_heads, tokens, head_dim)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        span: PrefillSpan,
        window: int | None = None,
    ) -> torch.Tensor:
        # q: [1, num_heads, num_tokens, head_dim]. Batched 4-D: given 3-D tensors, torch's CPU
        # SDPA takes its math path (2,048 tokens, 12 / 4 heads x 64, bf16: 320 against 10 ms).
        q = query.transpose(0, 1)[None]
        if span.start_position == 0 and window is None:
            # Nothing cached before the chunk: attend to the fresh K/V with a causal mask.
            out = self._attention(
                q,
                key.transpose(0, 1).to(q.dtype)[None],
                value.transpose(0, 1).to(q.dtype)[None],
                is_causal=True,
            )
            return out[0].transpose(0, 1)
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        context_len = span.context_len
        # keys, values: [num_kv_heads, context_len, head_dim]
        keys = key_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)
        values = value_cache.index_select(0, span.block_ids).view(-1, num_kv_heads, head_dim)
        keys, values = keys[:context_len].to(query.dtype), values[:context_len].to(query.dtype)
        # mask: [num_tokens, context_len]; query i sits at position start_position + i.
        query_positions = torch.arange(span.num_tokens, device=q.device) + span.start_position
        key_positions = torch.arange(context_len, device=q.device)[None, :]
        mask = key_positions <= query_positions[:, None]
        if window is not None:
            mask &= key_positions > query_positions[:, None] - window
        out = self._attention(
            q, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], mask=mask
        )
        return out[0].transpose(0, 1)
