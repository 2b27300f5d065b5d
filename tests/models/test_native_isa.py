"""The native decode kernel's instruction-set variants: every variant this CPU runs matches the
torch path, one it cannot run is refused with an error naming what is missing (never SIGILL),
and the choice follows the argument, then ``PDSERVE_NATIVE_ISA``, then the CPU's best."""

from __future__ import annotations

import pytest
import torch

from services.models.attention import TorchPagedAttention
from services.models.native_attention import NativePagedAttention
from services.models.native_build import (
    ISA_ENV,
    KERNEL_ISAS,
    UnsupportedIsaError,
    native_kernel_error,
    resolve_isa,
    supported_isas,
)
from support.decode_batch import SEQ_LENS, decode, make_decode_batch

HOST_ISAS = supported_isas()
AVX2_ONLY = frozenset({"sse2", "avx", "avx2", "fma"})


@pytest.fixture(scope="module")
def kernel() -> None:
    error = native_kernel_error()
    if error is not None:
        pytest.skip(f"native attention kernel unavailable: {error}")


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("isa", list(KERNEL_ISAS))
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [2, 5])
def test_each_variant_this_cpu_runs_matches_torch(
    isa: str, head_dim: int, dtype, group: int
) -> None:
    # group 5: more query heads per KV head than one register tile of pass 2 holds (4).
    if isa not in HOST_ISAS:
        pytest.skip(f"this CPU cannot run the {isa} kernel")
    query, kv_cache, metadata = make_decode_batch(
        SEQ_LENS, group=group, head_dim=head_dim, block_size=16, dtype=dtype
    )
    scale = head_dim**-0.5
    native = NativePagedAttention(16, scale, isa=isa)
    assert native.isa == isa

    out = decode(native, query, kv_cache, metadata)

    expected = decode(TorchPagedAttention(16, scale), query.float(), kv_cache.float(), metadata)
    assert out.dtype == dtype and not out.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:  # fp32 accumulation, then one rounding to bf16
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1.6e-2)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("isa", list(KERNEL_ISAS))
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"),
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_each_variant_reads_a_cache_of_another_dtype_like_torch(
    isa: str, head_dim: int, query_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """The kernel widens K/V from the cache's dtype, whatever the query's: the torch path on
    the same values (the cache's, widened to fp32) is the reference."""
    if isa not in HOST_ISAS:
        pytest.skip(f"this CPU cannot run the {isa} kernel")
    query, kv_cache, metadata = make_decode_batch(
        SEQ_LENS, group=2, head_dim=head_dim, block_size=16, dtype=torch.float32
    )
    query, kv_cache = query.to(query_dtype), kv_cache.to(cache_dtype)
    scale = head_dim**-0.5
    native = NativePagedAttention(16, scale, isa=isa)

    out = decode(native, query, kv_cache, metadata)

    torch_path = TorchPagedAttention(16, scale)
    if query_dtype == torch.float32:  # the torch path widens the bf16 cache itself
        expected = decode(torch_path, query, kv_cache, metadata)
    else:  # (it would round an fp32 cache to the bf16 query's dtype: widen both instead)
        expected = decode(torch_path, query.float(), kv_cache.float(), metadata)
    assert out.dtype == query_dtype and not out.isnan().any()
    if query_dtype == torch.float32:  # the only rounding is the cache's, shared by both sides
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:  # fp32 accumulation, then one rounding to bf16
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1.6e-2)


@pytest.mark.usefixtures("kernel")
def test_variants_agree_with_each_other_in_bfloat16() -> None:
    # Same maths at different widths: only the fp32 summation order differs before rounding.
    query, kv_cache, metadata = make_decode_batch(SEQ_LENS, head_dim=128, dtype=torch.bfloat16)
    outs = [decode(NativePagedAttention(16, 0.1, isa=isa), query, kv_cache, metadata)
            for isa in HOST_ISAS]  # fmt: skip
    for out in outs[1:]:
        torch.testing.assert_close(out.float(), outs[0].float(), atol=8e-3, rtol=8e-3)


def test_a_variant_the_cpu_cannot_run_is_refused_naming_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unset, as a run of the suite with a variant forced (PDSERVE_NATIVE_ISA=avx512) sets it.
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert resolve_isa(flags=AVX2_ONLY) == "avx2"
    with pytest.raises(
        UnsupportedIsaError,
        match=r"avx512_bf16 native kernel \(missing "
        r"avx512_bf16, avx512bw, avx512f, avx512vl\); it runs avx2, portable",
    ):
        resolve_isa("avx512_bf16", flags=AVX2_ONLY)
    with pytest.raises(UnsupportedIsaError, match="unknown native kernel variant 'sse9'"):
        resolve_isa("sse9")
    for isa in set(KERNEL_ISAS) - set(HOST_ISAS):  # on this host, if any
        with pytest.raises(UnsupportedIsaError, match=isa):
            NativePagedAttention(16, 0.1, isa=isa)


@pytest.mark.usefixtures("kernel")
def test_the_op_itself_refuses_an_unknown_variant() -> None:
    # The second guard, for callers of the op that skip resolve_isa.
    query, kv_cache, metadata = make_decode_batch([5], dtype=torch.float32)
    with pytest.raises(RuntimeError, match="unknown or unavailable kernel variant 'sse9'"):
        torch.ops.pdserve.paged_decode_attention(
            torch.empty_like(query), query, kv_cache[0], kv_cache[1],
            metadata.decode_block_tables, metadata.decode_seq_lens, 0.1, "sse9",
        )  # fmt: skip


def test_the_argument_wins_over_the_environment_which_wins_over_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert resolve_isa() == HOST_ISAS[0]
    assert HOST_ISAS[-1] == "portable"
    monkeypatch.setenv(ISA_ENV, "portable")
    assert resolve_isa() == "portable"
    assert resolve_isa(HOST_ISAS[0]) == HOST_ISAS[0]
    monkeypatch.setenv(ISA_ENV, "avx512_bf16")
    with pytest.raises(UnsupportedIsaError):
        resolve_isa(flags=AVX2_ONLY)


def test_a_source_missing_from_the_install_is_a_reason_not_a_crash(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed package without one of the headers (a packaging slip) must leave the node on
    the torch path with the reason, not kill it at start-up."""
    from services.models import native_build

    missing = tmp_path / "paged_attention_isa.h"
    monkeypatch.setattr(native_build, "_HEADERS", [missing])
    reason = native_build._build_and_load()
    assert reason is not None and "paged_attention_isa.h" in reason
