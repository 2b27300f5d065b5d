"""An fp8 E5M2 KV cache (``torch.float8_e5m2``, vLLM's ``fp8_e5m2``) in the native CPU kernels,
on every kernel variant this CPU runs: the cache write rounds K/V rows into it with the bits of
``.to(torch.float8_e5m2)``; decode attention over it gives the bits it gives over the same cache
widened to float32, and prefill attention those it gives over the cache widened to bfloat16 (every
E5M2 value is exact in both, and the widening is exact, infinities and NaN included: with a bf16
query the prefill kernel multiplies bf16 pairs, as over a bf16 cache); a value cache of another
dtype than the key cache's is refused."""

from __future__ import annotations

import math

import pytest
import torch

from services.models.amx_linear import amx_unavailable_reason
from services.models.native_build import native_kernel_error, supported_isas
from support.decode_batch import SEQ_LENS, make_decode_batch
from support.prefill_batch import PrefillStep, build_prefill_step

pytestmark = pytest.mark.skipif(
    native_kernel_error() is not None, reason=f"native kernels unavailable: {native_kernel_error()}"
)

FP8 = torch.float8_e5m2
DTYPES = [torch.float32, torch.bfloat16]
# The prefill op also has an amx variant (a bf16 cache only on the tiles; fp8 takes its bf16
# pairs, as avx512_bf16 does).
PREFILL_ISAS = supported_isas() + (["amx"] if amx_unavailable_reason() is None else [])
BF16_PAIR_ISAS = ("avx512_bf16", "amx")


def e5m2_values() -> torch.Tensor:
    """All 256 E5M2 bit patterns, as fp8 [256]: zeros of both signs, denormals, infinities,
    NaNs."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)


def rounding_cases() -> torch.Tensor:
    """float32 values at and around every rounding boundary of E5M2, both signs: each midpoint
    between neighbouring values (a tie, rounded to the even one), an ulp either side of it, the
    values themselves; the midpoint from the largest finite 57,344 to 2^16 (61,440, a tie to
    infinity) and past it; fp32 denormals, zeros, infinities, NaN."""
    finite = e5m2_values().float()
    finite = finite[finite.isfinite() & (finite >= 0)].unique()  # 0 .. 57344, ascending
    upper = torch.cat([finite[1:], torch.tensor([65536.0])])
    midpoints = (finite + upper) / 2  # exact in fp32: two significant bits more than E5M2's
    around = [
        midpoints,
        torch.nextafter(midpoints, torch.tensor(math.inf)),
        torch.nextafter(midpoints, torch.tensor(0.0)),
        finite,
    ]
    tiny = torch.tensor([2.0**-17, 3 * 2.0**-18, 2.0**-25, 1e-45, 1e-40, 2.0**-126])
    large = torch.tensor([57344.0, 60000.0, 61439.99, 65535.0, 65536.0, 1e6, 3e38])
    special = torch.tensor([0.0, math.inf, math.nan])
    positive = torch.cat([*around, tiny, large, special])
    return torch.cat([positive, -positive])


def write(rows: torch.Tensor, isa: str) -> torch.Tensor:
    """rows [n] written by the native op into an fp8 cache as K rows of 2 heads x 8, and as V rows
    in the reverse token order, to scattered slots; the bytes of both, in rows' order [2, n]."""
    padding = -rows.numel() % 16
    key = torch.cat([rows, rows[:padding]]).view(-1, 2, 8)
    value = key.flip(0)
    slots = torch.randperm(2 * key.shape[0], generator=torch.Generator().manual_seed(0))
    slots = slots[: key.shape[0]].contiguous()
    cache = torch.zeros(2, 2 * key.shape[0], 1, 2, 8, dtype=FP8)

    torch.ops.pdserve.write_kv_cache(cache[0], cache[1], key, value, slots, isa)

    key_bytes, value_bytes = cache.view(torch.uint8).view(2, -1, 16)[:, slots]
    return torch.stack([key_bytes.reshape(-1), value_bytes.flip(0).reshape(-1)])[:, : rows.numel()]


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_rounds_like_torchs_conversion(dtype: torch.dtype, isa: str) -> None:
    rows = rounding_cases().to(dtype)
    expected = rows.to(FP8).view(torch.uint8)

    written = write(rows, isa)

    for actual in written:
        mismatch = (actual != expected).nonzero().flatten()[:5]
        assert mismatch.numel() == 0, (
            f"inputs {rows[mismatch].tolist()} gave {actual[mismatch].tolist()}, "
            f"torch {expected[mismatch].tolist()}"
        )


@pytest.mark.parametrize("isa", supported_isas())
def test_cache_write_rounds_every_bf16_like_torch(isa: str) -> None:
    # Every bf16 bit pattern: each is widened to fp32 exactly, then rounded as an fp32 is.
    rows = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    written = write(rows, isa)

    assert torch.equal(written[0], rows.to(FP8).view(torch.uint8))
    assert torch.equal(written[1], written[0])


def decode(
    query: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, isa: str
) -> torch.Tensor:
    out = torch.empty_like(query)
    scale = query.shape[2] ** -0.5
    torch.ops.pdserve.paged_decode_attention(
        out, query, kv_cache[0], kv_cache[1], tables, lens, scale, isa
    )
    return out


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 48, 80])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(3, 1), (2, 4), (1, 5)])
def test_decode_over_fp8_gives_its_float32_widenings_bits(
    num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, isa: str
) -> None:
    # head_dim 48 and 80: the generic path (48 with a partial vector on AVX-512); the tables
    # scatter each sequence's blocks over the cache.
    query, kv_cache, metadata = make_decode_batch(
        SEQ_LENS, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype
    )
    cache = kv_cache.float().to(FP8)
    tables, lens = metadata.decode_block_tables, metadata.decode_seq_lens

    out = decode(query, cache, tables, lens, isa)

    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, decode(query, cache.float(), tables, lens, isa), atol=0, rtol=0)
    # And within a rounding of the bf16 widening, which the bf16 products (vdpbf16ps) may take.
    bf16 = decode(query, cache.bfloat16(), tables, lens, isa)
    torch.testing.assert_close(out.float(), bf16.float(), **tolerance(dtype))


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Another order of the same fp32 sums: a rounding of the output's dtype (bf16), or a few
    fp32 ulps."""
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    return {"rtol": rtol, "atol": rtol * 1e-1}


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("head_dim", [64, 48])
def test_every_fp8_value_is_widened_exactly(head_dim: int, isa: str) -> None:
    # One token of context: its probability is exactly 1, so the output is its V row as the
    # kernel widened it, infinities and NaNs included (every pattern, spread over the heads).
    values = e5m2_values().repeat(2)
    num_kv_heads = values.numel() // head_dim
    values = values[: num_kv_heads * head_dim].view(1, 1, num_kv_heads, head_dim)
    cache = torch.stack([torch.zeros_like(values.float()).to(FP8), values])
    query = torch.randn(1, num_kv_heads, head_dim)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)

    out = decode(query, cache, tables, lens, isa)

    expected = values.float().view(1, num_kv_heads, head_dim)
    torch.testing.assert_close(out, expected, atol=0, rtol=0, equal_nan=True)


def prefill(step: PrefillStep, cache: torch.Tensor, query: torch.Tensor, isa: str) -> torch.Tensor:
    """The step's chunks attended over `cache` (every chunk's K/V already in it)."""
    spans = step.metadata.prefills
    max_blocks = max(span.block_ids.numel() for span in spans)
    tables = torch.zeros(len(spans), max_blocks, dtype=torch.int64)
    for row, span in enumerate(spans):
        tables[row, : span.block_ids.numel()] = span.block_ids
    out = torch.zeros_like(query)
    torch.ops.pdserve.paged_prefill_attention(
        out, query, cache[0], cache[1], tables,
        torch.tensor([span.token_start for span in spans]),
        torch.tensor([span.num_tokens for span in spans]),
        torch.tensor([span.start_position for span in spans]),
        query.shape[2] ** -0.5, isa,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("isa", PREFILL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(4, 3, 64), (2, 1, 32), (1, 8, 128), (3, 5, 48)]
)
def test_prefill_over_fp8_gives_its_bf16_widenings_bits(
    num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, isa: str
) -> None:
    # Fresh prompts and chunks after cached tokens, around the kernels' tiles and key blocks;
    # head_dim 48: a partial vector on AVX-512, and fp32 FMAs whatever the query.
    step = build_prefill_step(
        [(0, 17), (0, 100), (31, 40), (5, 3)],
        block_size=16, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
    )  # fmt: skip
    cache = step.kv_cache.clone()
    for i, rows in enumerate((step.key, step.value)):
        cache[i].view(-1, num_kv_heads, head_dim)[step.metadata.slot_mapping] = rows
    cache = cache.to(FP8)
    query = step.query.to(dtype)

    out = prefill(step, cache, query, isa)

    assert out.dtype == dtype and not out.isnan().any()
    # A bf16 cache takes the same path (the amx variant's tiles aside, which take a bf16 cache
    # only: avx512_bf16 gives its pairs' bits), over the same values.
    bf16_isa = "avx512_bf16" if isa == "amx" else isa
    assert torch.equal(out, prefill(step, cache.bfloat16(), query, bf16_isa))
    widened = prefill(step, cache.float(), query, isa)  # fp32 FMAs, fp32 probabilities
    if dtype == torch.bfloat16 and head_dim % 32 == 0 and isa in BF16_PAIR_ISAS:
        # Multiplied in bf16 pairs (vdpbf16ps, with bf16 probabilities): within their rounding
        # of the fp32 products, and not those (the path taken is the pairs').
        torch.testing.assert_close(out.float(), widened.float(), rtol=2**-6, atol=2**-6)
        assert not torch.equal(out, widened)
    else:
        assert torch.equal(out, widened)


@pytest.mark.parametrize("isa", PREFILL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_prefill_widens_every_fp8_value_exactly(
    head_dim: int, dtype: torch.dtype, isa: str
) -> None:
    # One prompt token: its probability is exactly 1, so each head's output is its V row as the
    # kernel widened it (every pattern, spread over the heads; the K rows are zero). With a bf16
    # query and head_dim 64 or 128 on avx512_bf16 and amx, through the bf16 pairs.
    values = e5m2_values().repeat(2)
    num_kv_heads = values.numel() // head_dim
    values = values[: num_kv_heads * head_dim].view(1, 1, num_kv_heads, head_dim)
    cache = torch.stack([torch.zeros_like(values.float()).to(FP8), values])
    query = torch.randn(1, num_kv_heads, head_dim).to(dtype)
    out = torch.zeros_like(query)
    one = torch.ones(1, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)

    torch.ops.pdserve.paged_prefill_attention(
        out, query, cache[0], cache[1], zero.view(1, 1), zero, one, zero, head_dim**-0.5, isa
    )

    expected = values.float().view(1, num_kv_heads, head_dim)
    torch.testing.assert_close(out.float(), expected, atol=0, rtol=0, equal_nan=True)


def test_a_value_cache_of_another_dtype_is_refused() -> None:
    query, kv_cache, metadata = make_decode_batch([5, 20])
    cache = kv_cache.to(FP8)
    tables, lens = metadata.decode_block_tables, metadata.decode_seq_lens
    op = torch.ops.pdserve.paged_decode_attention
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="value_cache must have key_cache's dtype"):
        op(out, query, cache[0], kv_cache[1].bfloat16(), tables, lens, 0.125, "portable")
    with pytest.raises(RuntimeError, match="value_cache must have key_cache's dtype"):
        op(out, query, kv_cache[0], cache[1], tables, lens, 0.125, "portable")
    with pytest.raises(RuntimeError, match="key_cache must be float32, bfloat16 or float8_e5m2"):
        op(out, query, kv_cache[0].half(), kv_cache[1].half(), tables, lens, 0.125, "portable")
    with pytest.raises(RuntimeError, match="query must be float32 or bfloat16"):
        op(out.to(FP8), query.to(FP8), cache[0], cache[1], tables, lens, 0.125, "portable")
    rows = torch.zeros(3, kv_cache.shape[3], kv_cache.shape[4])
    with pytest.raises(RuntimeError, match="value_cache must have key_cache.s dtype Float8_e5m2"):
        torch.ops.pdserve.write_kv_cache(
            cache[0], kv_cache[1].bfloat16(), rows, rows, torch.tensor([0, 1, 2]), "portable"
        )
    with pytest.raises(RuntimeError, match="key_cache must be float32, bfloat16 or float8_e5m2"):
        torch.ops.pdserve.write_kv_cache(
            cache[0].view(torch.uint8), cache[1].view(torch.uint8), rows, rows,
            torch.tensor([0, 1, 2]), "portable",
        )  # fmt: skip
