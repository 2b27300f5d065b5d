"""CPU bfloat16 linears on oneDNN's blocked weight layout, packed once after loading.

Why: ``F.linear`` hands oneDNN a plain ``[out, in]`` weight, which it reorders into its blocked
(AVX-512 / AMX tile) layout inside every call. Packing each weight once with
``mkldnn._reorder_linear_weight`` (what torch.compile's CPU freezing pass does) removes that from
every step; the products are the same bits (``tests/models/test_packed_linear.py``). It matters
most where a step is small: a 64-sequence decode step multiplies 64 rows by every weight.

Life cycle: ``pack_linears`` runs once, after the checkpoint is loaded and before the first step,
and replaces the decoder's projections and the lm_head with ``PackedLinear`` modules. The plain
weight of a projection is dropped (no second copy in memory); a tied lm_head packs a copy and the
embedding keeps the plain matrix. Nothing reads or changes the weights afterwards.

Only CPU bfloat16 with oneDNN's bf16 support (``torch.ops.mkldnn._is_mkldnn_bf16_supported``):
elsewhere ``pack_linears`` leaves the model as it is and says why.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """``nn.Linear`` over a weight in oneDNN's layout; input ``[num_rows, in_features]``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        # The batch-size hint only picks the blocking; any number of rows works (tested).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def packing_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when ``pack_linears`` would pack for this device and dtype, else why not."""
    if device.type != "cpu":
        return f"{device.type} device (oneDNN packing is for the CPU)"
    if dtype != torch.bfloat16:
        return f"{dtype} (packing is used for bfloat16 only)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bfloat16 kernels for this CPU"
    return None


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replaces every ``nn.Linear`` of ``model`` with a ``PackedLinear`` when this device and
    dtype pack (see the module docstring); returns how many were packed."""
    reason = packing_unavailable_reason(device, dtype)
    if reason is not None:
        logger.info("linear weights stay in the plain layout: %s", reason)
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    with torch.no_grad():
        for parent, name, child in targets:
            setattr(parent, name, PackedLinear(child))
    logger.info("packed %d linear weights into oneDNN's blocked layout", len(targets))
    return len(targets)
