"""Linears packed into oneDNN's layout compute the plain layout's bits, at every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.models.packed_linear import (
    PackedLinear,
    PackedSiluGateUp,
    pack_linears,
    packing_unavailable_reason,
)

needs_packing = pytest.mark.skipif(
    packing_unavailable_reason(torch.device("cpu"), torch.bfloat16) is not None,
    reason=f"{packing_unavailable_reason(torch.device('cpu'), torch.bfloat16)}",
)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_packed_linear_gives_the_plain_bits(num_rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(num_rows)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(num_rows, 96, generator=generator).to(torch.bfloat16)
    with torch.no_grad():
        expected = F.linear(x, linear.weight, linear.bias)
        assert torch.equal(PackedLinear(linear)(x), expected)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_packed_silu_gate_up_is_silu_and_mul_within_bf16_rounding(
    num_rows: int, bias: bool
) -> None:
    generator = torch.Generator().manual_seed(num_rows)
    torch.manual_seed(num_rows)  # nn.Linear's initial weights
    gate_up = nn.Linear(96, 2 * 80, bias=bias).to(torch.bfloat16)
    x = (3 * torch.randn(num_rows, 96, generator=generator)).to(torch.bfloat16)
    with torch.no_grad():
        # The exact value, from the same bf16 inputs in float64.
        gate, up = F.linear(x.double(), gate_up.weight.double(), _double(gate_up.bias)).chunk(2, -1)
        exact = F.silu(gate) * up
        # What the unfused bf16 path computes: the product rounded, then SiLU-and-mul rounded.
        product = F.linear(x, gate_up.weight, gate_up.bias)
        gate16, up16 = product.chunk(2, -1)
        unfused = (F.silu(gate16.float()) * up16.float()).to(torch.bfloat16)
        fused = PackedSiluGateUp(gate_up)(x)

    assert fused.shape == (num_rows, 80) and fused.dtype == torch.bfloat16
    # Both paths round in bf16 (the unfused one three times, the fused one twice): each lands
    # within about two bf16 roundings of the exact value, the fused one no further than the
    # unfused one by much, and many elements (about half) agree exactly. A wrong half or a
    # missing SiLU is off by O(1).
    fused_error = _relative_error(fused, exact)
    assert fused_error <= 2**-7
    assert fused_error <= 1.5 * _relative_error(unfused, exact)
    assert (fused == unfused).float().mean() > 0.3


def _relative_error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return float((actual.double() - exact).norm() / exact.norm())


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


def test_packed_silu_gate_up_refuses_an_odd_width() -> None:
    with pytest.raises(ValueError, match="odd out_features"):
        PackedSiluGateUp(nn.Linear(8, 9, bias=False))


@pytest.mark.parametrize("num_rows", [1, 64, 300])
def test_float32_packing_agrees_with_mkl_to_summation_order(num_rows: int) -> None:
    torch.manual_seed(num_rows)
    linear, gate_up = nn.Linear(96, 160), nn.Linear(96, 2 * 80, bias=False)
    x = torch.randn(num_rows, 96)
    with torch.no_grad():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)
        gate, up = gate_up(x).chunk(2, -1)
        fused = PackedSiluGateUp(gate_up)(x)
        torch.testing.assert_close(fused, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(32, 48, bias=False)
        self.down_proj = nn.Linear(24, 32, bias=False)


@needs_packing
def test_pack_linears_fuses_silu_into_a_gate_up_projection() -> None:
    model = _Mlp().to(torch.bfloat16)
    x = torch.randn(5, 32).to(torch.bfloat16)
    with torch.no_grad():
        gate, up = model.gate_up_proj(x).chunk(2, -1)
        expected = model.down_proj((F.silu(gate.float()) * up.float()).to(torch.bfloat16))

        assert pack_linears(model, torch.device("cpu"), torch.bfloat16) == 2

        assert isinstance(model.gate_up_proj, PackedSiluGateUp)
        assert isinstance(model.down_proj, PackedLinear)
        assert model.gate_up_proj.num_weights == 32 * 48
        actual = model.down_proj(model.gate_up_proj(x))
    torch.testing.assert_close(actual, expected, rtol=2**-6, atol=2**-6)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.proj = nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight


@needs_packing
def test_pack_linears_replaces_every_linear_and_keeps_a_tied_embedding() -> None:
    model = _Tied().to(torch.bfloat16)
    ids = torch.tensor([3, 7, 49])
    with torch.no_grad():
        expected = model.head(model.proj(model.embed(ids)))
        embedding = model.embed.weight.clone()

        assert pack_linears(model, torch.device("cpu"), torch.bfloat16) == 2

        assert isinstance(model.proj, PackedLinear) and isinstance(model.head, PackedLinear)
        assert torch.equal(model.embed.weight, embedding)
        assert torch.equal(model.head(model.proj(model.embed(ids))), expected)


def test_a_tied_lm_head_stays_plain_in_float32() -> None:
    model = _Tied()
    ids = torch.tensor([3, 7, 49])
    with torch.no_grad():
        expected = model.head(model.proj(model.embed(ids)))

        assert pack_linears(model, torch.device("cpu"), torch.float32) == 1

        assert isinstance(model.proj, PackedLinear) and type(model.head) is nn.Linear
        assert model.head.weight is model.embed.weight  # still shared: no second copy
        torch.testing.assert_close(model.head(model.proj(model.embed(ids))), expected)


@pytest.mark.parametrize(
    ("device", "dtype", "reason"),
    [("cpu", torch.float16, "bfloat16 and float32 only"), ("meta", torch.bfloat16, "for the CPU")],
)
def test_pack_linears_leaves_other_devices_and_dtypes_alone(
    device: str, dtype: torch.dtype, reason: str
) -> None:
    model = _Tied().to(dtype)
    assert reason in (packing_unavailable_reason(torch.device(device), dtype) or "")
    assert pack_linears(model, torch.device(device), dtype) == 0
    assert type(model.proj) is nn.Linear
