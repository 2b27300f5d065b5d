"""The native prefill attention kernel (``paged_prefill_attention``) against a dense float64
reference and the torch path, on every kernel variant this CPU runs."""

from __future__ import annotations

import math

import pytest
import torch

from services.models.amx_linear import SWITCH_ENV, amx_unavailable_reason
from services.models.attention import AttentionMetadata, TorchPagedAttention
from services.models.native_attention import NATIVE_PREFILL, NativePagedAttention
from services.models.native_build import native_kernel_error, supported_isas
from support.prefill_batch import PrefillStep, build_prefill_step, dense_reference
from support.torch_threads import torch_threads

pytestmark = pytest.mark.skipif(
    native_kernel_error() is not None, reason=f"native kernels unavailable: {native_kernel_error()}"
)

# Every variant this CPU runs; amx multiplies bf16 on the tiles where head_dim is a multiple of
# 32 (else it runs its avx512_bf16 vector path).
ISAS = supported_isas() + (["amx"] if amx_unavailable_reason() is None else [])
# The variants that multiply a bf16 query and cache in bf16 pairs (vdpbf16ps, the AMX tiles)
# where head_dim is a multiple of 32.
BF16_PRODUCTS = ("avx512_bf16", "amx")

CHUNKS = {
    # Fresh prompts of lengths around the kernel's tiles (16 tokens x group 3 = 48 rows) and key
    # blocks (32 keys on AVX-512, 16 on 16-register ISAs).
    "fresh": [(0, 1), (0, 16), (0, 17), (0, 33), (0, 100)],
    # Chunks after cached tokens (prefix hits, the rest of a prompt): keys before the chunk.
    "after cached tokens": [(5, 3), (31, 40), (64, 1), (100, 70)],
}
DTYPES = {
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float32, bf16 cache": (torch.float32, torch.bfloat16),
}


def run_native(
    step: PrefillStep,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    isa: str | None = None,
    query: torch.Tensor | None = None,
) -> torch.Tensor:
    """The backend's whole forward (K/V written to the cache, then attended), native kernel,
    variant ``isa`` (default: the backend's own choice)."""
    head_dim = step.query.shape[2]
    backend = NativePagedAttention(step.kv_cache.shape[2], 1 / math.sqrt(head_dim))
    assert backend.prefill_kernel == NATIVE_PREFILL
    if isa is not None:
        backend.prefill_isa = isa
    backend.prepare(step.metadata)
    return backend.forward(
        (step.query if query is None else query).to(dtype),
        step.key.to(dtype),
        step.value.to(dtype),
        step.kv_cache.to(cache_dtype),
        step.metadata,
    )


def expected(step: PrefillStep, cache_dtype: torch.dtype) -> torch.Tensor:
    """The dense reference for every chunk's rows, from K/V rounded as the cache holds them."""
    out = torch.empty(step.query.shape, dtype=torch.float64)
    for span, (keys, values) in zip(step.metadata.prefills, step.full_kv, strict=True):
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        k, v = (t.to(cache_dtype).double() for t in (keys, values))
        out[rows] = dense_reference(step.query[rows].double(), k, v, span.start_position)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtypes", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("chunks", list(CHUNKS.values()), ids=list(CHUNKS))
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"),
    [(4, 3, 64), (2, 1, 32), (1, 8, 128), (2, 2, 96), (3, 5, 40), (1, 64, 16)],
)
def test_matches_the_dense_reference(
    chunks: list[tuple[int, int]],
    dtypes: tuple[torch.dtype, torch.dtype],
    isa: str,
    num_kv_heads: int,
    group: int,
    head_dim: int,
) -> None:
    # head_dim 40: a partial vector on every ISA; 96: a partial value tile of the bf16 pair
    # products (6 vectors of 16); group 64: more rows than one item's tile.
    dtype, cache_dtype = dtypes
    step = build_prefill_step(
        chunks, block_size=16, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim
    )
    query = step.query.to(dtype)

    out = run_native(step, dtype, cache_dtype, isa)

    assert out.dtype == dtype and out.shape == query.shape
    exact = expected(PrefillStep(query.float(), *_rest(step)), cache_dtype)
    error = (out.double() - exact).abs()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    elif isa in BF16_PRODUCTS and head_dim % 32 == 0:
        # The products take bf16 pairs: the probabilities are rounded to it too (relative 2^-9
        # each, as torch's flash kernel does), so the error is bounded by the values' size too.
        largest_value = max(v.abs().max().item() for _, v in step.full_kv)
        assert (error <= (exact.abs() + largest_value) * 2**-8).all()
    else:
        # fp32 accumulation: off only by rounding the output to bf16 (half an ulp, <= 2^-9).
        assert (error <= exact.abs() * 2**-8 + 1e-6).all()


def _rest(step: PrefillStep) -> tuple:
    return step.key, step.value, step.kv_cache, step.metadata, step.full_kv


@pytest.mark.parametrize("block_size", [1, 4, 16, 48])
def test_any_block_size_and_agrees_with_the_torch_path(block_size: int) -> None:
    step = build_prefill_step(
        [(0, 50), (13, 29), (40, 2)], block_size=block_size, num_kv_heads=2, group=3, head_dim=64
    )
    torch_path = TorchPagedAttention(block_size, 1 / 8)
    torch_path.prepare(step.metadata)
    reference = torch_path.forward(
        step.query, step.key, step.value, step.kv_cache.clone(), step.metadata
    )

    out = run_native(step, torch.float32, torch.float32)

    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_decodes_and_chunks_in_one_step() -> None:
    # Two decoding requests (contexts of 20 and 7, their new token last) before two chunks.
    step = build_prefill_step(
        [(19, 1), (6, 1), (0, 40), (8, 9)], block_size=16, num_kv_heads=2, group=3, head_dim=64
    )
    spans = step.metadata.prefills
    tables = torch.zeros(2, 2, dtype=torch.int64)
    for row, span in enumerate(spans[:2]):
        tables[row, : span.block_ids.numel()] = span.block_ids
    metadata = AttentionMetadata(
        slot_mapping=step.metadata.slot_mapping,
        num_decodes=2,
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor([20, 7]),
        prefills=spans[2:],
    )

    out = run_native(PrefillStep(step.query, step.key, step.value, step.kv_cache, metadata,
                                 step.full_kv), torch.float32, torch.float32)  # fmt: skip

    torch.testing.assert_close(out.double(), expected(step, torch.float32), atol=1e-5, rtol=1e-5)


def test_reads_the_query_as_a_view_of_the_qkv_rows() -> None:
    # The model hands over q as a slice of the fused QKV projection's rows: no copy is made.
    step = build_prefill_step([(0, 30), (5, 20)], block_size=16, num_kv_heads=2, group=3,
                              head_dim=32)  # fmt: skip
    num_tokens, heads, dim = step.query.shape
    qkv = torch.randn(num_tokens, (heads + 4) * dim)
    qkv[:, : heads * dim] = step.query.reshape(num_tokens, -1)
    view = qkv[:, : heads * dim].view(num_tokens, heads, dim)
    assert not view.is_contiguous()

    out = run_native(step, torch.float32, torch.float32, query=view)

    torch.testing.assert_close(out, run_native(step, torch.float32, torch.float32), atol=0, rtol=0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_never_reads_past_the_context_nor_writes_other_rows(dtype: torch.dtype, isa: str) -> None:
    step = build_prefill_step([(0, 20), (9, 14)], block_size=16, num_kv_heads=2, group=3,
                              head_dim=64)  # fmt: skip
    cache = step.kv_cache.to(dtype)
    used = torch.zeros(cache.shape[1], 16, dtype=torch.bool)
    for span in step.metadata.prefills:
        for position in range(span.context_len):
            used[span.block_ids[position // 16], position % 16] = True
    cache[:, ~used] = float("nan")  # the rest of each last block, and every other block
    query = step.query.to(dtype)
    # Rows of the flat batch outside the chunks (decodes' rows) are the caller's.
    out = torch.full((query.shape[0] + 3, *query.shape[1:]), 7.0, dtype=dtype)
    chunks = [(s.token_start + 3, s.num_tokens, s.start_position) for s in step.metadata.prefills]
    tables = torch.stack([torch.cat([s.block_ids, torch.full((4,), 10**6)])
                          for s in step.metadata.prefills])  # fmt: skip
    write_new_kv(cache, step)

    torch.ops.pdserve.paged_prefill_attention(
        out, torch.cat([query[:3], query]), cache[0], cache[1], tables,
        *(torch.tensor(column) for column in zip(*chunks, strict=True)), 0.125, isa,
    )  # fmt: skip

    assert (out[:3] == 7).all() and not out[3:].isnan().any()
    expected = run_native(step, dtype, dtype, isa)
    torch.testing.assert_close(out[3:], expected, atol=0, rtol=0)


def write_new_kv(cache: torch.Tensor, step: PrefillStep) -> None:
    """What the backend's forward does before it attends: the chunks' K/V into their slots."""
    for i, new in enumerate((step.key, step.value)):
        flat = cache[i].view(-1, *cache.shape[3:])
        flat.index_copy_(0, step.metadata.slot_mapping, new.to(cache.dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("last_key", [1.0, 6.0, 12.0])
def test_a_later_larger_score_rescales_what_came_before(isa: str, last_key: float) -> None:
    # Keys growing along the context: each key block raises every row's maximum score (bf16
    # and head_dim 32: amx's tiles). A row's running maximum moves only when a block's exceeds
    # it by more than 2^8, and the sums before are rescaled then. From gentle to steep: up to
    # 1.0 it never moves after the first block (later probabilities exceed 1), up to 12.0 it
    # moves at almost every block of every variant.
    step = build_prefill_step([(0, 130)], block_size=16, num_kv_heads=1, group=2, head_dim=32)
    keys = torch.linspace(0.1, last_key, 130)[:, None, None] * torch.ones(130, 1, 32)
    values = step.full_kv[0][1]
    step = PrefillStep(step.query.abs(), keys, values, step.kv_cache, step.metadata,
                       [(keys, values)])  # fmt: skip

    for dtype in (torch.float32, torch.bfloat16):
        out = run_native(PrefillStep(step.query.to(dtype).float(), *_rest(step)), dtype, dtype, isa)
        exact = expected(PrefillStep(step.query.to(dtype).float(), *_rest(step)), dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(out.double(), exact, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("isa", ISAS)
def test_a_score_past_exps_range_moves_the_maximum(isa: str) -> None:
    # Keys 0-99 score 0, keys 100-129 about 170: exp(170) is past fp32's range, so a row that
    # sees them must move its maximum to them (and rescale the sums of the keys before), not
    # stay behind. Equal scores make the exact weights uniform over the keys a row sees.
    step = build_prefill_step([(0, 130)], block_size=16, num_kv_heads=1, group=2, head_dim=32)
    keys = torch.zeros(130, 1, 32)
    keys[100:] = 30.0
    values = step.full_kv[0][1]
    step = PrefillStep(torch.ones_like(step.query), keys, values, step.kv_cache, step.metadata,
                       [(keys, values)])  # fmt: skip

    for dtype in (torch.float32, torch.bfloat16):
        out = run_native(step, dtype, dtype, isa)
        exact = expected(step, dtype)
        assert exact[-1].sub(values[100:].to(dtype).double().mean(0)).abs().max() < 1e-12
        tolerance = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(out.double(), exact, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kernel", ["native", "sdpa"])
def test_the_cache_write_and_the_output_match_the_torch_backend(kernel: str) -> None:
    # fp32 compute over a bf16 cache: the native backend writes K/V in one pass (its own op),
    # and a torch prefill kernel on it still attends to the rounded K/V of its fresh chunks.
    step = build_prefill_step([(0, 40), (20, 9)], block_size=16, num_kv_heads=2, group=3,
                              head_dim=64)  # fmt: skip
    native = NativePagedAttention(16, 0.125)
    native.prefill_kernel = kernel
    results = []
    for backend in (TorchPagedAttention(16, 0.125), native):
        cache = step.kv_cache.to(torch.bfloat16)
        backend.prepare(step.metadata)
        out = backend.forward(step.query, step.key, step.value, cache, step.metadata)
        results.append((out, cache))
    (reference, reference_cache), (out, cache) = results
    assert torch.equal(cache, reference_cache)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 3])
def test_same_result_for_any_thread_count(num_threads: int) -> None:
    step = build_prefill_step([(0, 200), (3, 5), (60, 90)], block_size=16, num_kv_heads=4,
                              group=3, head_dim=64)  # fmt: skip
    reference = run_native(step, torch.float32, torch.float32)
    with torch_threads(num_threads):
        out = run_native(step, torch.float32, torch.float32)
    torch.testing.assert_close(out, reference, atol=0, rtol=0)


@pytest.mark.skipif(amx_unavailable_reason() is not None, reason="needs a CPU with AMX")
def test_amx_is_the_prefill_variant_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert NativePagedAttention(16, 0.125).prefill_isa == "amx"
    assert NativePagedAttention(16, 0.125, isa="avx512").prefill_isa == "avx512"
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert NativePagedAttention(16, 0.125).prefill_isa == "avx512_bf16"


def test_rejects_bad_inputs() -> None:
    step = build_prefill_step([(0, 20), (4, 10)], block_size=16, num_kv_heads=2, group=3,
                              head_dim=64)  # fmt: skip
    op = torch.ops.pdserve.paged_prefill_attention
    query, cache = step.query, step.kv_cache
    tables = torch.stack([torch.cat([s.block_ids, s.block_ids[:1]])[:2]
                          for s in step.metadata.prefills])  # fmt: skip
    good = {
        "out": torch.empty_like(query),
        "query": query,
        "key_cache": cache[0],
        "value_cache": cache[1],
        "block_tables": tables,
        "query_starts": torch.tensor([0, 20]),
        "query_lens": torch.tensor([20, 10]),
        "start_positions": torch.tensor([0, 4]),
    }

    def call(isa: str = "portable", **changes: torch.Tensor) -> None:
        op(*{**good, **changes}.values(), 0.125, isa)

    call()  # the good arguments pass
    bad: dict[str, dict] = {
        "overlap an earlier chunk": {"query_starts": torch.tensor([0, 19])},
        "leave the 30 query rows": {"query_lens": torch.tensor([20, 11])},
        "is negative": {"query_lens": torch.tensor([-1, 10])},
        "outside \\[0, max_blocks": {"start_positions": torch.tensor([0, 30])},
        # fp32 positions are exact up to 2^24; a table wide enough that nothing else objects.
        "past 2\\^24 positions": {
            "block_tables": torch.zeros(2, (1 << 20) + 1, dtype=torch.long),
            "start_positions": torch.tensor([0, 1 << 24]),
        },
        "outside the cache's": {"block_tables": tables.clone().fill_(cache.shape[1])},
        "query_lens must be \\[num_chunks=2\\]": {"query_lens": torch.tensor([20])},
        "start_positions must be int64": {"start_positions": torch.tensor([0.0, 4.0])},
        "out must have query's dtype": {"out": torch.empty_like(query).bfloat16()},
        "value_cache must have key_cache's dtype": {"value_cache": cache[1].bfloat16()},
        "query's rows must each be contiguous": {"query": query.transpose(1, 2)},
        "out must be contiguous": {"out": torch.empty_like(query).transpose(0, 1)[:, :, :]},
        "not a multiple of num_kv_heads": {"query": query[:, :5], "out": torch.empty(30, 5, 64)},
        "unknown or unavailable kernel variant": {"isa": "sse9"},
    }
    for message, changes in bad.items():
        with pytest.raises(RuntimeError, match=message):
            call(**changes)
