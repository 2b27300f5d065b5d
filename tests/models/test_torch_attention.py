"""The torch paged-attention path: the padded batched prefill equals one call per chunk, and
both equal a dense reference computed from unpaged K/V."""

from __future__ import annotations

import math

import pytest
import torch

from services.models.attention import (
    PADDED_KERNELS,
    PaddedPrefill,
    PrefillSpan,
    TorchPagedAttention,
)
from support.prefill_batch import build_prefill_step, dense_reference

BLOCK_SIZE = 4
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 16
NUM_HEADS = NUM_KV_HEADS * GROUP


def build_step(chunks: list[tuple[int, int]], seed: int = 0):
    """The inputs, metadata, each request's full K/V, at this file's shapes."""
    step = build_prefill_step(
        chunks, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, group=GROUP,
        head_dim=HEAD_DIM, seed=seed,
    )  # fmt: skip
    return step.query, step.key, step.value, step.kv_cache, step.metadata, step.full_kv


CASES = {
    "fresh, equal lengths": [(0, 8), (0, 8), (0, 8)],
    "cached prefixes, equal lengths": [(8, 6), (0, 6), (4, 6)],
    "the rest of a prompt beside fresh chunks": [(4, 4), (0, 8), (0, 8), (0, 5)],
    "fresh, mixed lengths": [(0, 7), (0, 5), (0, 6)],
    "cached prefixes": [(8, 6), (4, 7), (12, 5)],
    "prefix and fresh mixed": [(0, 9), (9, 8), (5, 9)],
}


@pytest.mark.parametrize("kernel", PADDED_KERNELS)
@pytest.mark.parametrize("chunks", list(CASES.values()), ids=list(CASES))
def test_padded_prefill_equals_per_chunk_and_dense(
    chunks: list[tuple[int, int]], kernel: str
) -> None:
    query, key, value, kv_cache, metadata, full_kv = build_step(chunks)
    padded_step = PaddedPrefill.build(metadata.prefills, BLOCK_SIZE)
    assert padded_step is not None, "case must batch"
    # Fresh chunks take SDPA's own causal mask, the others the boolean one.
    assert padded_step.all_fresh == all(start == 0 for start, _ in chunks)
    # Slots are positions (no mask) when no context outgrows the longest chunk.
    longest = max(length for _, length in chunks)
    assert padded_step.aligned == all(start + length <= longest for start, length in chunks)
    # Equal lengths, one after the other: queries and outputs are views, not gathers.
    equal = len({length for _, length in chunks}) == 1
    assert (padded_step.contiguous_start == 0) if equal else padded_step.contiguous_start is None
    backend = TorchPagedAttention(BLOCK_SIZE, scale=1 / math.sqrt(HEAD_DIM))
    backend.prefill_kernel = kernel

    backend.prepare(metadata)
    padded = backend.forward(query, key, value, kv_cache.clone(), metadata)
    backend._padded = None  # force one call per chunk
    per_chunk = backend.forward(query, key, value, kv_cache.clone(), metadata)

    torch.testing.assert_close(padded, per_chunk, atol=1e-5, rtol=1e-5)
    for span, (k_all, v_all) in zip(metadata.prefills, full_kv, strict=True):
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        expected = dense_reference(query[rows], k_all, v_all, span.start_position)
        torch.testing.assert_close(padded[rows], expected, atol=1e-5, rtol=1e-5)


def test_padded_rows_follow_the_chunks_past_the_decodes() -> None:
    blocks = torch.arange(1)  # one block of BLOCK_SIZE (4) covers each chunk
    # Five decode rows first, then three 4-token chunks: rows 5..16.
    equal = [PrefillSpan(5 + 4 * i, 4, 0, blocks) for i in range(3)]
    padded = PaddedPrefill.build(equal, BLOCK_SIZE)
    assert padded is not None and padded.contiguous_start == 5
    assert padded.real_rows.tolist() == list(range(5, 17))

    mixed = [PrefillSpan(5, 4, 0, blocks), PrefillSpan(9, 3, 0, blocks)]
    padded = PaddedPrefill.build(mixed, BLOCK_SIZE)
    assert padded is not None and padded.contiguous_start is None
    assert padded.real_slots.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert padded.real_rows.tolist() == [5, 6, 7, 8, 9, 10, 11]


def test_a_step_without_prepare_never_uses_the_last_steps_batch() -> None:
    backend = TorchPagedAttention(BLOCK_SIZE, scale=1 / math.sqrt(HEAD_DIM))
    _, _, _, _, earlier, _ = build_step([(0, 8), (0, 8)], seed=1)
    backend.prepare(earlier)
    query, key, value, kv_cache, metadata, full_kv = build_step([(4, 5), (0, 6)])

    output = backend.forward(query, key, value, kv_cache, metadata)  # no prepare for this step

    for span, (k_all, v_all) in zip(metadata.prefills, full_kv, strict=True):
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        expected = dense_reference(query[rows], k_all, v_all, span.start_position)
        torch.testing.assert_close(output[rows], expected, atol=1e-5, rtol=1e-5)


def test_padding_that_wastes_too_much_work_is_not_batched() -> None:
    _, _, _, _, metadata, _ = build_step([(0, 40), (0, 2), (0, 2)])
    assert PaddedPrefill.build(metadata.prefills, BLOCK_SIZE) is None


def test_a_single_chunk_is_not_batched() -> None:
    _, _, _, _, metadata, _ = build_step([(0, 8)])
    assert PaddedPrefill.build(metadata.prefills, BLOCK_SIZE) is None
