"""The fp32 few-row linear reads oneDNN's packed weight and computes what oneDNN computes, to
fp32's summation order, on every kernel variant this CPU runs; it refuses a weight packed any
other way, packed modules take it only for the batches it is faster at, and a bad argument is an
error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.models import fp32_linear
from services.models.fp32_linear import (
    SWITCH_ENV,
    Fp32FewRowWeight,
    fp32_linear_unavailable_reason,
)
from services.models.native_build import ISA_ENV, native_kernel_error, supported_isas
from services.models.packed_linear import PackedLinear, PackedSiluGateUp
from support.few_row_kernels import assert_bad_arguments_are_named, count_rows
from support.torch_threads import torch_threads


@pytest.fixture(autouse=True)
def kernels() -> None:
    reason = fp32_linear_unavailable_reason()
    if reason is not None:
        pytest.skip(f"no fp32 few-row kernel here: {reason}")


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two torch threads for the test, whatever the host's count (the panel rule depends on it)."""
    with torch_threads(2):
        yield


def _packed(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) / 8
    return weight, torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def _rows(num_rows: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, width, generator=generator)


def _view(weight: torch.Tensor, packed: torch.Tensor, isa: str) -> Fp32FewRowWeight:
    few_rows = Fp32FewRowWeight.of(weight, packed)
    if few_rows is None and not Fp32FewRowWeight.in_layout(weight, packed):
        # oneDNN picks its blocking per CPU and shape: on a real AVX2 host (AMD EPYC) it packs
        # [192, 48] in 16-wide panels, [1280, 768] in 64-wide ones; the engine then keeps
        # oneDNN's GEMM for that weight (test_a_weight_packed_another_way_stays_on_onednn).
        pytest.skip(f"oneDNN packs a {tuple(weight.shape)} weight another way on this CPU")
    assert few_rows is not None
    return Fp32FewRowWeight(few_rows.packed, few_rows.address, few_rows.in_features,
                            few_rows.out_features, isa)  # fmt: skip


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("num_rows", [1, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("shape", [(192, 48), (1280, 768), (256, 528)])
def test_fp32_linear_computes_what_onednn_computes(
    isa: str, shape: tuple[int, int], num_rows: int
) -> None:
    # Rows around the register tile's 6 and past it; 48 inputs, no multiple of 32; 528 inputs,
    # two whole blocks of the kernel's 256 and a part of one.
    out_features, in_features = shape
    weight, packed = _packed(out_features, in_features, seed=num_rows)
    bias = _rows(1, out_features, seed=7)[0]
    x = _rows(num_rows, in_features, seed=num_rows + 1)

    actual = _view(weight, packed, isa).linear(x, bias)

    exact = F.linear(x.double(), weight.double(), bias.double())
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    assert actual.shape == (num_rows, out_features) and actual.dtype == torch.float32
    # fp32 sums in another order: a few ulps of the terms' size. A wrong panel, row or input
    # order is off by O(1).
    tolerance = 1e-6 * (in_features**0.5)
    torch.testing.assert_close(actual.double(), exact, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(actual, onednn, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("isa", supported_isas())
def test_fp32_epilogues_are_onednns_swish_and_mul(isa: str) -> None:
    # 400 inputs: the kernel keeps its sums in the output between blocks of 256 inputs and
    # applies the epilogue after the last block only.
    weight, packed = _packed(128, 400, seed=1)
    other = _rows(9, 128, seed=2)
    x = 3 * _rows(9, 400, seed=3)
    few_rows = _view(weight, packed, isa)

    silu = few_rows.linear(x, None, "silu")
    product = few_rows.linear(x, None, "mul", other)

    onednn_silu = torch.ops.mkldnn._linear_pointwise(x, packed, None, "swish", [], "")
    onednn_product = torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, None, "mul")
    exact = F.linear(x.double(), weight.double())
    torch.testing.assert_close(silu.double(), F.silu(exact), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(product.double(), exact * other.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(silu, onednn_silu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(product, onednn_product, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 3])
def test_same_result_for_any_thread_count(num_threads: int) -> None:
    # Each thread prefetches its next panel while it multiplies one: the split must not matter.
    weight, packed = _packed(640, 96, seed=4)
    few_rows = Fp32FewRowWeight.of(weight, packed)
    assert few_rows is not None
    x = _rows(20, 96, seed=5)
    reference = few_rows.linear(x)
    with torch_threads(num_threads):
        out = few_rows.linear(x)
    assert torch.equal(out, reference)


def test_a_weight_packed_another_way_stays_on_onednn() -> None:
    weight, packed = _packed(128, 96, seed=6)
    assert Fp32FewRowWeight.of(weight, packed) is not None
    changed = weight.clone()
    changed[37, 50] += 1  # one element that is not where the layout says: refused
    assert Fp32FewRowWeight.of(changed, packed) is None
    # Not a multiple of 64 outputs (or of 16 inputs): oneDNN pads its panels, which the kernel
    # does not read.
    for shape in ((160, 96), (128, 40)):
        odd_weight, odd_packed = _packed(*shape, seed=7)
        assert Fp32FewRowWeight.of(odd_weight, odd_packed) is None
    # bf16 weights are the AMX kernel's.
    assert Fp32FewRowWeight.of(weight.to(torch.bfloat16), packed) is None


def test_bad_arguments_name_the_argument() -> None:
    weight, packed = _packed(128, 96, seed=8)
    few_rows = Fp32FewRowWeight.of(weight, packed)
    assert few_rows is not None
    x = _rows(4, 96, seed=9)
    assert_bad_arguments_are_named(few_rows.linear, x, 128)
    with pytest.raises(RuntimeError, match="out_features a positive multiple of 64"):
        torch.ops.pdserve.fp32_linear(x, few_rows.address, 96, 96, None, "none", None, "avx2")
    with pytest.raises(RuntimeError, match="unknown or unavailable kernel variant 'sse9'"):
        torch.ops.pdserve.fp32_linear(x, few_rows.address, 96, 128, None, "none", None, "sse9")


def test_packed_linears_take_the_fp32_kernel_up_to_max_rows(
    monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 256)  # 4 panels: 2 a thread
    gate_up = nn.Linear(96, 2 * 256, bias=False)
    with torch.no_grad():
        packed, fused = PackedLinear(linear), PackedSiluGateUp(gate_up)
    assert isinstance(packed.few_rows, Fp32FewRowWeight) and fused.few_rows is not None
    assert "fp32 few-row" in repr(packed) and "fp32 few-row" in repr(fused)

    calls = count_rows(monkeypatch, Fp32FewRowWeight)
    limit = packed.few_rows.max_rows
    with torch.no_grad():
        for num_rows in (1, limit, limit + 1):
            x = _rows(num_rows, 96, seed=num_rows)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
            gate, up = gate_up(x).chunk(2, -1)
            torch.testing.assert_close(fused(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    # One call for the linear and two (gate, up) for the MLP, at 1 and max_rows rows only.
    assert calls == [1, 1, 1, limit, limit, limit]


def test_a_weight_with_fewer_than_two_panels_a_thread_stays_on_onednn(two_threads: None) -> None:
    weight, packed = _packed(256, 48, seed=13)  # 4 panels of 64 outputs
    few_rows = Fp32FewRowWeight.of(weight, packed)
    assert few_rows is not None
    x = _rows(8, 48, seed=14)
    assert few_rows.takes(x)
    assert not few_rows.takes(_rows(few_rows.max_rows + 1, 48, seed=15))
    torch.set_num_threads(3)
    assert not few_rows.takes(x)


def test_the_switch_and_the_portable_variant_keep_every_linear_on_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = torch.zeros(64, 64)
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert fp32_linear_unavailable_reason() == f"{SWITCH_ENV}=0"
    assert Fp32FewRowWeight.of(weight, weight) is None  # decided before the layout is looked at
    monkeypatch.setenv(SWITCH_ENV, "1")
    monkeypatch.setenv(ISA_ENV, "sse9")
    assert "sse9" in str(fp32_linear_unavailable_reason())  # said, not raised
    monkeypatch.setenv(ISA_ENV, "portable")
    assert fp32_linear_unavailable_reason() == "the portable variant (it runs on AVX2 or AVX-512)"
    monkeypatch.setattr(fp32_linear, "native_kernel_error", lambda: "no compiler")
    assert fp32_linear_unavailable_reason() == "native CPU kernels are unavailable: no compiler"
    assert native_kernel_error() is None  # the module's own, untouched

    def no_build() -> str | None:
        raise AssertionError("the native kernels were built for a CPU without AVX2")

    monkeypatch.setattr(fp32_linear, "native_kernel_error", no_build)
    monkeypatch.setattr(fp32_linear, "cpu_flags", lambda: frozenset({"sse2"}))
    assert fp32_linear_unavailable_reason() == "this CPU lacks avx2, fma"
