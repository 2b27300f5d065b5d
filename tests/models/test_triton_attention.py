"""The Triton paged-attention kernels equal ``TorchPagedAttention`` (the reference).

On CPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py);
with CUDA the same tests run the compiled kernels. Inputs are fresh random values, block tables
are scattered over the cache, every slot no request owns holds NaN (a kernel that reads outside
a context poisons its output), and outputs start as NaN (a row the kernel skips stays NaN).
Shapes are kept small: the interpreter runs each program in Python.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.models.attention import AttentionMetadata, PrefillSpan, TorchPagedAttention

triton_attention = pytest.importorskip("services.models.triton_attention")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_BLOCKS = 48
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_cache(
    gen: torch.Generator, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], all NaN until written
    return torch.full(
        (2, NUM_BLOCKS, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    )


def build_step(
    decode_lens: list[int],
    chunks: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """decode_lens: context length of each decode (its new token included); chunks:
    (start_position, num_tokens) of each prefill chunk. Every request's blocks are drawn at
    random from the whole cache; its cached prefix is written, the step's new K/V are not."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = make_cache(gen, block_size, num_kv_heads, head_dim, dtype)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    num_heads = num_kv_heads * group

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    def place(context: int, cached: int) -> list[int]:
        block_ids = [free_blocks.pop() for _ in range(-(-context // block_size))]
        for pos in range(cached):
            block, offset = block_ids[pos // block_size], pos % block_size
            kv_cache[:, block, offset] = rand(2, num_kv_heads, head_dim)
        return block_ids

    slots: list[int] = []
    tables: list[list[int]] = []
    spans: list[PrefillSpan] = []
    num_tokens = len(decode_lens) + sum(n for _, n in chunks)
    for seq_len in decode_lens:
        block_ids = place(seq_len, seq_len - 1)
        pos = seq_len - 1
        slots.append(block_ids[pos // block_size] * block_size + pos % block_size)
        tables.append(block_ids)
    token_start = len(decode_lens)
    for start, n in chunks:
        block_ids = place(start + n, start)
        slots += [
            block_ids[p // block_size] * block_size + p % block_size
            for p in range(start, start + n)
        ]
        spans.append(PrefillSpan(token_start, n, start, torch.tensor(block_ids, device=DEVICE)))
        token_start += n
    width = max((len(t) for t in tables), default=0)
    # Decode tables padded with a block some other request owns: the kernel must not read it.
    pad = spans[0].block_ids[0].item() if spans else 0
    padded = [t + [pad] * (width - len(t)) for t in tables]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        num_decodes=len(decode_lens),
        decode_block_tables=torch.tensor(padded, dtype=torch.int64, device=DEVICE).view(
            len(decode_lens), width
        ),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int64, device=DEVICE),
        prefills=spans,
    )
    query = rand(num_tokens, num_heads, head_dim)
    key, value = rand(num_tokens, num_kv_heads, head_dim), rand(num_tokens, num_kv_heads, head_dim)
    return query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), kv_cache.to(DEVICE), metadata


def reference(query, key, value, kv_cache, metadata, block_size: int) -> torch.Tensor:
    """TorchPagedAttention in float32 on a NaN-free copy of the cache (its padded decode reads
    masked slots, where 0 * NaN would poison even a correct result)."""
    cache = torch.nan_to_num(kv_cache.float(), nan=0.0)
    backend = TorchPagedAttention(block_size, 1.0 / math.sqrt(query.shape[-1]))
    backend.prepare(metadata)
    return backend.forward(query.float(), key.float(), value.float(), cache, metadata)


SHAPES = {
    # (block_size, num_kv_heads, group, head_dim)
    "gqa4-d32-b16": (16, 2, 4, 32),
    "mha-d24-b8": (8, 2, 1, 24),  # head_dim not a power of two, block smaller than a tile
}
STEPS = {
    # (decode context lengths, prefill chunks as (start_position, num_tokens))
    "decodes only": ([1, 17, 70, 133], []),
    "prefills with cached prefixes": ([], [(0, 9), (20, 37), (45, 1)]),
    "mixed": ([5, 64, 65], [(0, 40), (16, 7)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("step", list(STEPS.values()), ids=list(STEPS))
def test_forward_matches_torch_backend(step, shape, dtype: torch.dtype) -> None:
    block_size, num_kv_heads, group, head_dim = shape
    decode_lens, chunks = step
    query, key, value, kv_cache, metadata = build_step(
        decode_lens,
        chunks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        seed=hash((tuple(decode_lens), tuple(chunks), shape)) % 1000,
    )
    backend = triton_attention.TritonPagedAttention(block_size, 1.0 / math.sqrt(head_dim))
    backend.prepare(metadata)
    cache = kv_cache.clone()
    out = backend.forward(query, key, value, cache, metadata)
    expected = reference(query, key, value, kv_cache.clone(), metadata, block_size)

    assert out.dtype == dtype and out.shape == query.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # The step's new K/V landed in their slots.
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat[0, metadata.slot_mapping], key, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, metadata.slot_mapping], value, atol=0, rtol=0)


@pytest.mark.parametrize("step", list(STEPS.values()), ids=list(STEPS))
def test_qkv_as_views_of_the_fused_projection_are_read_in_place(step) -> None:
    # The model hands attention q, k and v as strided views of its QKV projection's output
    # (rows q + 2 kv wide); the backend reads them there (the query without a copy, K and V
    # into the cache by _write_kv_kernel): the output and the cache are the contiguous ones'.
    block_size, num_kv_heads, group, head_dim = SHAPES["gqa4-d32-b16"]
    decode_lens, chunks = step
    query, key, value, kv_cache, metadata = build_step(
        decode_lens, chunks, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, dtype=torch.float32, seed=7,
    )  # fmt: skip
    num_tokens = query.shape[0]
    qkv = torch.cat(
        [query.flatten(1), key.flatten(1), value.flatten(1)], dim=1
    )  # [num_tokens, (heads + 2 kv heads) * head_dim]
    q_size, kv_size = query[0].numel(), key[0].numel()
    views = (
        qkv[:, :q_size].view(query.shape),
        qkv[:, q_size : q_size + kv_size].view(key.shape),
        qkv[:, q_size + kv_size :].view(value.shape),
    )
    assert not any(v.is_contiguous() for v in views)
    outs, caches = [], []
    for q, k, v in ((query, key, value), views):
        backend = triton_attention.TritonPagedAttention(block_size, 1.0 / math.sqrt(head_dim))
        backend.prepare(metadata)
        caches.append(kv_cache.clone())
        outs.append(backend.forward(q, k, v, caches[-1], metadata))

    assert outs[1].shape == (num_tokens, *query.shape[1:]) and outs[1].is_contiguous()
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("num_seqs, max_len", [(1, 600), (3, 200)])
def test_decode_splits_merge_exactly(num_seqs: int, max_len: int) -> None:
    """A long context split over several programs (flash-decoding) merges to the reference,
    including splits that start past a shorter sequence's end (empty splits)."""
    block_n = triton_attention.tile_config(16, torch.float32).decode_block_n
    num_splits, partition = triton_attention.decode_num_splits(num_seqs, 2, max_len, block_n)
    assert num_splits > 1 and partition % block_n == 0
    lens = [max_len - 37 * i for i in range(num_seqs)]
    lens[-1] = max(1, lens[-1] // 4)
    query, key, value, kv_cache, metadata = build_step(
        lens,
        [],
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_dim=16,
        dtype=torch.float32,
        seed=7,
    )
    # Write the new tokens as TorchPagedAttention would, then call the kernel directly.
    flat = kv_cache.view(2, -1, 2, 16)
    flat[0, metadata.slot_mapping], flat[1, metadata.slot_mapping] = key, value
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_decode(
        out,
        query,
        kv_cache[0],
        kv_cache[1],
        metadata.decode_block_tables,
        metadata.decode_seq_lens,
        0.25,
    )
    expected = reference(query, key, value, kv_cache, metadata, 16)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_prefill_leaves_other_rows_untouched() -> None:
    """paged_prefill writes exactly the chunks' rows: decode rows pre-filled with NaN stay NaN."""
    query, key, value, kv_cache, metadata = build_step(
        [3, 9],
        [(0, 5), (8, 6)],
        block_size=4,
        num_kv_heads=1,
        group=2,
        head_dim=16,
        dtype=torch.float32,
        seed=3,
    )
    flat = kv_cache.view(2, -1, 1, 16)
    flat[0, metadata.slot_mapping], flat[1, metadata.slot_mapping] = key, value
    spans = metadata.prefills
    out = torch.full_like(query, float("nan"))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=DEVICE)  # noqa: E731
    triton_attention.paged_prefill(
        out,
        query,
        kv_cache[0],
        kv_cache[1],
        torch.nn.utils.rnn.pad_sequence([s.block_ids for s in spans], batch_first=True),
        as_tensor([s.token_start for s in spans]),
        as_tensor([s.num_tokens for s in spans]),
        as_tensor([s.start_position for s in spans]),
        max(s.num_tokens for s in spans),
        0.25,
    )
    assert out[:2].isnan().all()
    expected = reference(query, key, value, kv_cache, metadata, 4)
    torch.testing.assert_close(out[2:], expected[2:], atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("step", list(STEPS.values()), ids=list(STEPS))
def test_bf16_matches_torch_backend_on_gpu(step) -> None:
    """bf16 ``tl.dot`` is wrong under the interpreter, so bf16 is checked on a GPU only."""
    decode_lens, chunks = step
    query, key, value, kv_cache, metadata = build_step(
        decode_lens,
        chunks,
        block_size=16,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        dtype=torch.bfloat16,
        seed=11,
    )
    backend = triton_attention.TritonPagedAttention(16, 1.0 / 8)
    backend.prepare(metadata)
    out = backend.forward(query, key, value, kv_cache.clone(), metadata)
    expected = reference(query, key, value, kv_cache.clone(), metadata, 16)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.models.backends import make_attention_backend

    cuda = make_attention_backend("auto", torch.device("cuda"), block_size=16, scale=1.0)
    assert isinstance(cuda, triton_attention.TritonPagedAttention)
    cpu = make_attention_backend("auto", torch.device("cpu"), block_size=16, scale=1.0)
    assert not isinstance(cpu, triton_attention.TritonPagedAttention)
    # Outside the interpreter, Triton kernels cannot take CPU tensors: a clear error.
    monkeypatch.setattr(triton_attention, "INTERPRET", False)
    with pytest.raises(ValueError, match="attention_backend 'triton' is unavailable.*CUDA"):
        make_attention_backend("triton", torch.device("cpu"), block_size=16, scale=1.0)
