"""The bf16 few-row linear (AVX512-BF16 without AMX) reads oneDNN's packed weight and computes
what oneDNN computes, to fp32's summation order and one bf16 rounding; it refuses a weight packed
any other way, packed modules take it only for the batches it is faster at, and a bad argument is
an error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.models import bf16_linear
from services.models.amx_linear import amx_unavailable_reason
from services.models.bf16_linear import (
    SWITCH_ENV,
    Bf16FewRowWeight,
    bf16_linear_unavailable_reason,
)
from services.models.native_build import ISA_ENV, native_kernel_error
from services.models.packed_linear import (
    PackedLinear,
    PackedSiluGateUp,
    packing_unavailable_reason,
)
from support.few_row_kernels import assert_bad_arguments_are_named, count_rows
from support.torch_threads import torch_threads


def _needs_kernel() -> None:
    reason = bf16_linear_unavailable_reason()
    if reason is not None:
        pytest.skip(f"no bf16 few-row kernel here: {reason}")


def _packed(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The kernel reads oneDNN's packed weight; an AVX2 CPU has no oneDNN bf16 packing (the
    # engine then keeps bf16 linears unpacked, so this kernel never runs there).
    reason = packing_unavailable_reason(torch.device("cpu"), torch.bfloat16)
    if reason is not None:
        pytest.skip(f"no bf16 weight to read here: {reason}")
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) / 8).bfloat16()
    return weight, torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def _rows(num_rows: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, width, generator=generator).bfloat16()


def _view(weight: torch.Tensor, packed: torch.Tensor) -> Bf16FewRowWeight:
    _needs_kernel()
    few_rows = Bf16FewRowWeight.of(weight, packed)
    if few_rows is None and amx_unavailable_reason() is None:
        pytest.skip("oneDNN packs bf16 weights in the AMX tile layout on this CPU")
    assert few_rows is not None
    return few_rows


def _assert_one_rounding(actual: torch.Tensor, exact: torch.Tensor, in_features: int) -> None:
    """fp32 sums in another order, then one rounding to bf16: within a bf16 ulp of the exact
    value (2^-8 relative) plus the sums' fp32 error. A wrong panel, row or input pair is off by
    O(1)."""
    assert actual.dtype == torch.bfloat16
    error = (actual.double() - exact).abs()
    assert (error <= exact.abs() * 2**-8 + 1e-5 * in_features**0.5).all()


@pytest.mark.parametrize("num_rows", [1, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("shape", [(192, 96), (1280, 768)])
def test_bf16_linear_computes_what_onednn_computes(shape: tuple[int, int], num_rows: int) -> None:
    # Rows around the register tile's 6 and past it; 96 inputs: no multiple of 64.
    out_features, in_features = shape
    weight, packed = _packed(out_features, in_features, seed=num_rows)
    bias = _rows(1, out_features, seed=7)[0]
    x = _rows(num_rows, in_features, seed=num_rows + 1)

    actual = _view(weight, packed).linear(x, bias)

    exact = F.linear(x.double(), weight.double(), bias.double())
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    assert actual.shape == (num_rows, out_features)
    _assert_one_rounding(actual, exact, in_features)
    # oneDNN sums in its own order: the two differ by a bf16 rounding at most.
    torch.testing.assert_close(actual, onednn, rtol=2**-7, atol=1e-3)


def test_bf16_epilogues_are_onednns_swish_and_mul() -> None:
    weight, packed = _packed(128, 96, seed=1)
    other = _rows(9, 128, seed=2)
    x = 3 * _rows(9, 96, seed=3)
    few_rows = _view(weight, packed)

    silu = few_rows.linear(x, None, "silu")
    product = few_rows.linear(x, None, "mul", other)

    exact = F.linear(x.double(), weight.double())
    # Applied to the fp32 sums before the one rounding, as oneDNN's post-ops are.
    _assert_one_rounding(silu, F.silu(exact), 96)
    _assert_one_rounding(product, exact * other.double(), 96)
    onednn_silu = torch.ops.mkldnn._linear_pointwise(x, packed, None, "swish", [], "")
    onednn_product = torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, None, "mul")
    torch.testing.assert_close(silu, onednn_silu, rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(product, onednn_product, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("num_threads", [1, 3])
def test_same_result_for_any_thread_count(num_threads: int) -> None:
    # Each thread prefetches its next panel while it multiplies one: the split must not matter.
    weight, packed = _packed(640, 96, seed=4)
    few_rows = _view(weight, packed)
    x = _rows(20, 96, seed=5)
    reference = few_rows.linear(x)
    with torch_threads(num_threads):
        out = few_rows.linear(x)
    assert torch.equal(out, reference)


def test_a_weight_packed_another_way_stays_on_onednn() -> None:
    weight, packed = _packed(128, 96, seed=6)
    _view(weight, packed)
    changed = weight.clone()
    changed[37, 50] += 1  # one element that is not where the layout says: refused
    assert Bf16FewRowWeight.of(changed, packed) is None
    # Not a multiple of 64 outputs (or of 32 inputs): oneDNN pads its panels, which the kernel
    # does not read.
    for shape in ((160, 96), (128, 48)):
        odd_weight, odd_packed = _packed(*shape, seed=7)
        assert Bf16FewRowWeight.of(odd_weight, odd_packed) is None
    # fp32 weights are the fp32 kernel's.
    assert Bf16FewRowWeight.of(weight.float(), packed) is None


def test_bad_arguments_name_the_argument() -> None:
    weight, packed = _packed(128, 96, seed=8)
    few_rows = _view(weight, packed)
    x = _rows(4, 96, seed=9)
    assert_bad_arguments_are_named(few_rows.linear, x, 128)
    with pytest.raises(RuntimeError, match="out_features a positive multiple of 64"):
        torch.ops.pdserve.bf16_linear(x, few_rows.address, 96, 96, None, "none", None,
                                      "avx512_bf16")  # fmt: skip
    with pytest.raises(RuntimeError, match="in_features must be a positive even number"):
        torch.ops.pdserve.bf16_linear(_rows(4, 95, seed=13), few_rows.address, 95, 128, None,
                                      "none", None, "avx512_bf16")  # fmt: skip
    with pytest.raises(RuntimeError, match="isa must be avx512_bf16, got 'avx2'"):
        torch.ops.pdserve.bf16_linear(x, few_rows.address, 96, 128, None, "none", None, "avx2")


def test_packed_linears_take_the_bf16_kernel_up_to_max_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _needs_kernel()
    torch.manual_seed(0)
    linear = nn.Linear(96, 64 * 2 * torch.get_num_threads()).bfloat16()  # 2 panels a thread
    gate_up = nn.Linear(96, 2 * linear.out_features, bias=False).bfloat16()
    with torch.no_grad():
        packed, fused = PackedLinear(linear), PackedSiluGateUp(gate_up)
    if amx_unavailable_reason() is None:
        pytest.skip("AMX's kernel takes bf16 linears on this CPU")
    assert isinstance(packed.few_rows, Bf16FewRowWeight) and fused.few_rows is not None
    assert "bf16 few-row" in repr(packed) and "bf16 few-row" in repr(fused)

    calls = count_rows(monkeypatch, Bf16FewRowWeight)
    limit = packed.few_rows.max_rows
    with torch.no_grad():
        for num_rows in (1, limit, limit + 1):
            x = _rows(num_rows, 96, seed=num_rows)
            exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
            _assert_one_rounding(packed(x), exact, 96)
            gate, up = F.linear(x.double(), gate_up.weight.double()).chunk(2, -1)
            # Rounded twice (SiLU's product, then the mul's), as oneDNN's two GEMMs round.
            torch.testing.assert_close(fused(x).double(), F.silu(gate) * up, rtol=2**-6,
                                       atol=1e-3)  # fmt: skip
    # One call for the linear and two (gate, up) for the MLP, at 1 and max_rows rows only.
    assert calls == [1, 1, 1, limit, limit, limit]


def test_the_switch_and_other_variants_keep_every_linear_on_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert bf16_linear_unavailable_reason() == f"{SWITCH_ENV}=0"
    assert Bf16FewRowWeight.of(weight, weight) is None  # decided before the layout is looked at
    monkeypatch.setenv(SWITCH_ENV, "1")
    monkeypatch.setattr(bf16_linear, "cpu_flags", lambda: frozenset(bf16_linear.KERNEL_ISAS[
        "avx512_bf16"]))  # fmt: skip
    monkeypatch.setenv(ISA_ENV, "sse9")
    assert "sse9" in str(bf16_linear_unavailable_reason())  # said, not raised
    monkeypatch.setenv(ISA_ENV, "portable")
    assert bf16_linear_unavailable_reason() == (
        "the portable variant is forced (the kernel is avx512_bf16's)"
    )
    monkeypatch.setattr(bf16_linear, "native_kernel_error", lambda: "no compiler")
    assert bf16_linear_unavailable_reason() == "native CPU kernels are unavailable: no compiler"
    assert native_kernel_error() is None  # the module's own, untouched

    def no_build() -> str | None:
        raise AssertionError("the native kernels were built for a CPU without AVX512-BF16")

    monkeypatch.setattr(bf16_linear, "native_kernel_error", no_build)
    monkeypatch.setattr(bf16_linear, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert bf16_linear_unavailable_reason() == ("this CPU lacks avx512_bf16, avx512bw, avx512vl")
