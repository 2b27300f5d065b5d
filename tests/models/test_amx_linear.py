"""The AMX few-row linear reads oneDNN's packed weight and computes what oneDNN computes, to a
bf16 rounding; it refuses a weight packed any other way, and a bad argument is an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.models import amx_linear
from services.models.amx_linear import MAX_ROWS, SWITCH_ENV, FewRowWeight, amx_unavailable_reason
from services.models.cpu_features import cpu_flags
from services.models.native_build import native_kernel_error
from services.models.packed_linear import PackedLinear, PackedSiluGateUp
from support.few_row_kernels import assert_bad_arguments_are_named, count_rows


@pytest.fixture
def amx() -> None:
    reason = amx_unavailable_reason()
    if reason is not None:
        pytest.skip(f"no AMX kernel here: {reason}")


def _packed(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) / 8).to(torch.bfloat16)
    return weight, torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def _rows(num_rows: int, in_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, in_features, generator=generator).to(torch.bfloat16)


def _relative_error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return float((actual.double() - exact).norm() / exact.norm())


@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 7, 16, 17, 32, 33, 100, MAX_ROWS])
@pytest.mark.parametrize("shape", [(160, 96), (1280, 768)])
def test_amx_linear_computes_what_onednn_computes(
    shape: tuple[int, int], num_rows: int, bias: bool
) -> None:
    out_features, in_features = shape
    weight, packed = _packed(out_features, in_features, seed=num_rows)
    bias_vector = _rows(1, out_features, seed=7)[0] if bias else None
    x = _rows(num_rows, in_features, seed=num_rows + 1)
    few_rows = FewRowWeight.of(weight, packed)
    assert few_rows is not None

    actual = few_rows.linear(x, bias_vector)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, bias_vector, "none", [], "")
    exact_bias = None if bias_vector is None else bias_vector.double()
    exact = F.linear(x.double(), weight.double(), exact_bias)

    assert actual.shape == (num_rows, out_features) and actual.dtype == torch.bfloat16
    # Both accumulate in fp32 and round once; they may sum in another order, so an element may
    # differ by a bf16 rounding, never more. A wrong block, row or pair order is off by O(1).
    assert _relative_error(actual, exact) <= 2**-8
    assert _relative_error(actual, exact) <= 1.25 * _relative_error(onednn, exact)
    ulp = torch.finfo(torch.bfloat16).eps * onednn.double().abs()
    assert bool(((actual.double() - onednn.double()).abs() <= ulp + 1e-6).all())


@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("num_rows", [3, 64])
def test_amx_epilogues_are_onednns_swish_and_mul(num_rows: int) -> None:
    weight, packed = _packed(192, 128, seed=1)
    other = _rows(num_rows, 192, seed=2)
    x = 3 * _rows(num_rows, 128, seed=3)
    few_rows = FewRowWeight.of(weight, packed)
    assert few_rows is not None

    silu = few_rows.linear(x, None, "silu")
    onednn_silu = torch.ops.mkldnn._linear_pointwise(x, packed, None, "swish", [], "")
    product = few_rows.linear(x, None, "mul", other)
    onednn_product = torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, None, "mul")

    exact = F.linear(x.double(), weight.double())
    assert _relative_error(silu, F.silu(exact)) <= 2**-7
    assert _relative_error(product, exact * other.double()) <= 2**-7
    torch.testing.assert_close(silu, onednn_silu, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(product, onednn_product, rtol=2**-7, atol=2**-7)


# Puts x's last byte at the end of a page whose successor is unmapped (PROT_NONE), multiplies,
# and checks the result: a tile load of 16 rows from a partial group in place would fault.
_GUARD_PAGE_SCRIPT = """
import ctypes, mmap, sys
import torch
import torch.nn.functional as F
from services.models.amx_linear import FewRowWeight

num_rows, in_features, out_features = int(sys.argv[1]), 96, 160
page = mmap.PAGESIZE
memory = mmap.mmap(-1, 3 * page)  # two pages for x, then the guard
start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(start + 2 * page, page, 0) == 0
readable = torch.frombuffer(memory, dtype=torch.bfloat16, count=page)
x = readable[page - num_rows * in_features :].view(num_rows, in_features)
x.copy_(torch.randn(num_rows, in_features).to(torch.bfloat16))
weight = (torch.randn(out_features, in_features) / 8).to(torch.bfloat16)
few_rows = FewRowWeight.of(weight, torch.ops.mkldnn._reorder_linear_weight(weight, 64))
assert few_rows is not None
exact = x.double() @ weight.double().T
error = float((few_rows.linear(x).double() - exact).norm() / exact.norm())
assert error < 2**-7, error
print("ok")
"""


@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("num_rows", [7, 16, 23, 40])
def test_amx_reads_no_row_past_x(num_rows: int) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _GUARD_PAGE_SCRIPT, str(num_rows)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        f"rc {result.returncode}: {result.stderr[-2000:]}"
    )


@pytest.mark.usefixtures("amx")
def test_a_weight_packed_another_way_stays_on_onednn() -> None:
    weight, packed = _packed(160, 96, seed=4)
    assert FewRowWeight.of(weight, packed) is not None
    changed = weight.clone()
    changed[37, 50] += 1  # one element that is not where the layout says: refused
    assert FewRowWeight.of(changed, packed) is None
    # Not a multiple of 32: oneDNN pads its blocks, which the kernel does not read.
    odd_weight, odd_packed = _packed(100, 96, seed=5)
    assert FewRowWeight.of(odd_weight, odd_packed) is None
    # float32 weights are not AMX's.
    assert FewRowWeight.of(weight.float(), packed) is None


@pytest.mark.usefixtures("amx")
def test_bad_arguments_name_the_argument() -> None:
    weight, packed = _packed(160, 96, seed=6)
    few_rows = FewRowWeight.of(weight, packed)
    assert few_rows is not None
    x = _rows(4, 96, seed=7)
    assert_bad_arguments_are_named(few_rows.linear, x, 160)


@pytest.mark.usefixtures("amx")
def test_packed_linears_take_the_amx_kernel_up_to_max_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=False).to(torch.bfloat16)
    gate_up = nn.Linear(96, 2 * 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        packed, fused = PackedLinear(linear), PackedSiluGateUp(gate_up)
    assert packed.few_rows is not None and fused.few_rows is not None
    assert "amx" in repr(packed) and "amx" in repr(fused)

    calls = count_rows(monkeypatch, FewRowWeight)
    with torch.no_grad():
        for num_rows in (1, MAX_ROWS, MAX_ROWS + 1):
            x = _rows(num_rows, 96, seed=num_rows)
            torch.testing.assert_close(packed(x), linear(x), rtol=2**-7, atol=2**-7)
            gate, up = gate_up(x).chunk(2, -1)
            expected = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
            torch.testing.assert_close(fused(x), expected, rtol=2**-6, atol=2**-6)
    # One call for the linear and two (gate, up) for the MLP, at 1 and MAX_ROWS rows only.
    assert calls == [1, 1, 1, MAX_ROWS, MAX_ROWS, MAX_ROWS]


def test_the_switch_keeps_every_linear_on_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert amx_unavailable_reason() == f"{SWITCH_ENV}=0"
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert FewRowWeight.of(weight, weight) is None  # decided before the layout is looked at


def test_a_cpu_without_amx_flags_is_told_so_without_a_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(amx_linear, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))

    def no_build() -> str | None:
        raise AssertionError("the native kernels were built for a CPU without AMX")

    monkeypatch.setattr(amx_linear, "native_kernel_error", no_build)
    assert amx_unavailable_reason() == "this CPU lacks amx_bf16, amx_tile, avx512_bf16"
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert FewRowWeight.of(weight, weight) is None


def test_without_amx_the_op_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    if native_kernel_error() is not None:
        pytest.skip(f"native CPU kernels are unavailable: {native_kernel_error()}")
    reason = torch.ops.pdserve.amx_linear_unavailable_reason()
    if not reason:
        pytest.skip("this CPU runs the AMX kernel (the tests above cover it)")
    # A CPU whose flags lack AMX is told so by name without asking the op; otherwise (the tile
    # permission refused, say) the op's own reason is passed on.
    missing = sorted({"amx_bf16", "amx_tile", "avx512_bf16"} - cpu_flags())
    expected = f"this CPU lacks {', '.join(missing)}" if missing else reason
    assert amx_linear.amx_unavailable_reason() == expected
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="amx_linear: "):
        torch.ops.pdserve.amx_linear(x, 1, 32, 32, None, "none", None)
