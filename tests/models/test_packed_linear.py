"""Linears packed into oneDNN's layout compute the plain layout's bits, at every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.models.packed_linear import PackedLinear, pack_linears, packing_unavailable_reason

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


@pytest.mark.parametrize(
    ("device", "dtype", "reason"),
    [("cpu", torch.float32, "bfloat16 only"), ("meta", torch.bfloat16, "for the CPU")],
)
def test_pack_linears_leaves_other_devices_and_dtypes_alone(
    device: str, dtype: torch.dtype, reason: str
) -> None:
    model = _Tied().to(dtype)
    assert reason in (packing_unavailable_reason(torch.device(device), dtype) or "")
    assert pack_linears(model, torch.device(device), dtype) == 0
    assert type(model.proj) is nn.Linear
