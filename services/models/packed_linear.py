"""CPU linears on oneDNN's blocked weight layout, packed once after loading.

Why, in bfloat16: ``F.linear`` hands oneDNN a plain ``[out, in]`` weight, which it reorders into
its blocked (AVX-512 / AMX tile) layout inside every call. Packing each weight once with
``mkldnn._reorder_linear_weight`` (what torch.compile's CPU freezing pass does) removes that from
every step; the products are the same bits (``tests/models/test_packed_linear.py``). It matters
most where a step is small: a 64-sequence decode step multiplies 64 rows by every weight.

In float32 (what ``--dtype auto`` picks on a CPU without fast bf16), ``F.linear`` runs MKL on
the plain weight. oneDNN's packed kernel is 16-19 % faster at the 64 rows of a decode step and
3 % slower at 2,048 prefill rows (the small model's shapes, two cores); with the fused SiLU below,
a fp32 engine run took 10 % less per decode step and 3-8 % less per prefill step (AVX-512 host,
oneDNN's bf16 kernels switched off). The products differ from MKL's in summation order only
(within 1e-5 relative, tested). MKL's own packed format was faster still but takes 2.2x the
weight's memory; oneDNN's takes the same bytes.

A module's fused ``gate_up_proj`` (the ``[gate; up]`` projection of a SwiGLU MLP, whose output
only ever goes through SiLU-and-mul) becomes a ``PackedSiluGateUp``, which runs SiLU-and-mul in
oneDNN's GEMM epilogues: the ``[rows, 2 x intermediate]`` product is never written out and read
back (a 2,048-token prefill step of the small model: 6.0 against 7.1 ms a layer, measured with
``torch.nn.functional.silu``; the native ``silu_and_mul`` pass took 1.75 ms of it).

A batch of few rows (a decode step) runs one of our own kernels over the same packed buffer
instead, where it is faster than oneDNN's: in bf16 on a CPU with AMX, up to
``amx_linear.MAX_ROWS`` rows on the tiles (``amx_linear.py``: oneDNN's kernel streams the weights
at about half the memory's rate there); in bf16 on a CPU with AVX512-BF16 and no AMX, up to
``bf16_linear.MAX_ROWS`` rows on ``vdpbf16ps`` (``bf16_linear.py``); in fp32, up to
``fp32_linear.MAX_ROWS`` rows (64) on the vector units (``fp32_linear.py``).
The last two stream the next weights under the arithmetic. Larger batches stay on oneDNN's.

Life cycle: ``pack_linears`` runs once, after the checkpoint is loaded and before the first step,
and replaces the decoder's projections and the lm_head with ``PackedLinear`` modules (and
``PackedSiluGateUp`` for each ``gate_up_proj``). The plain weight of a projection is dropped (no
second copy in memory). A lm_head tied to the embedding packs a copy in bf16 (the embedding keeps
the plain matrix); in fp32 it stays plain, sharing the embedding's weight, because MKL has no
per-call reorder to save and a copy would cost the vocabulary's fp32 matrix again (113 MB for
SmolLM2-135M). Nothing reads or changes the weights afterwards.

Only on the CPU, in float32, or in bfloat16 with oneDNN's bf16 support
(``torch.ops.mkldnn._is_mkldnn_bf16_supported``): elsewhere ``pack_linears`` leaves the model as
it is and says why.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from services.models import amx_linear, fp32_linear
from services.models.amx_linear import FewRowWeight
from services.models.bf16_linear import Bf16FewRowWeight
from services.models.fp32_linear import Fp32FewRowWeight
from services.models.native_build import resolve_isa

logger = logging.getLogger(__name__)


FewRowView = FewRowWeight | Fp32FewRowWeight
"""Our few-row kernels' views of a packed weight: each ``takes`` some batches and runs
``linear`` with oneDNN's epilogues."""


def few_row_view(weight: torch.Tensor, packed: torch.Tensor) -> FewRowView | None:
    """The few-row kernel for this weight's dtype reading ``packed``, or None where it does not
    run here (bf16: ``amx_linear`` on a CPU with AMX, else ``bf16_linear``; fp32:
    ``fp32_linear``)."""
    return (
        FewRowWeight.of(weight, packed)
        or Bf16FewRowWeight.of(weight, packed)
        or Fp32FewRowWeight.of(weight, packed)
    )


def few_row_label(view: FewRowView | None) -> str:
    """``extra_repr``'s note of which few-row kernel a module has."""
    if view is None:
        return ""
    if isinstance(view, FewRowWeight):
        return ", amx"
    if isinstance(view, Bf16FewRowWeight):
        return ", bf16 few-row"
    return f", fp32 few-row {view.isa}"


REORDER_BATCH_HINT = 64
"""The batch size oneDNN's reorder is told to expect: it only picks the blocking, and any number
of rows works (tested); weights packed for 64, 256 or 2,048 rows ran 2,048-row GEMMs alike
(docs/benchmarks.md, issue 21, nineteenth pass), and this one keeps the layout the few-row
kernels read."""


class PackedLinear(nn.Module):
    """``nn.Linear`` over a weight in oneDNN's layout; input ``[num_rows, in_features]``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, REORDER_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.few_rows = few_row_view(weight, self.packed)
        """Our few-row kernel's view of ``packed`` for the batches it ``takes``, or None."""

    @property
    def num_weights(self) -> int:
        """Parameters of the plain weight (the packed tensor's size includes its padding)."""
        return self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows is not None and self.few_rows.takes(x):
            return self.few_rows.linear(x, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, packed"
            f"{few_row_label(self.few_rows)}"
        )


class PackedSiluGateUp(nn.Module):
    """A SwiGLU MLP's fused ``[gate; up]`` projection followed by SiLU-and-mul, as two packed
    GEMMs: ``silu(x @ gate.T) * (x @ up.T)``, input ``[num_rows, in_features]``, output
    ``[num_rows, intermediate]``. The first GEMM applies SiLU ("swish") to its fp32 accumulators
    before rounding; the second multiplies its accumulators by the first's output ("mul" binary
    post-op) before rounding. In bf16, against ``silu_and_mul`` of the rounded product, this
    rounds twice instead of three times: within a bf16 rounding or two of it (tested)."""

    def __init__(self, gate_up: nn.Linear) -> None:
        super().__init__()
        if gate_up.out_features % 2:
            raise ValueError(f"gate_up_proj has an odd out_features ({gate_up.out_features})")
        self.in_features = gate_up.in_features
        self.out_features = gate_up.out_features // 2
        gate, up = gate_up.weight.detach().chunk(2, dim=0)
        self.gate = torch.ops.mkldnn._reorder_linear_weight(gate.contiguous(), REORDER_BATCH_HINT)
        self.up = torch.ops.mkldnn._reorder_linear_weight(up.contiguous(), REORDER_BATCH_HINT)
        gate_bias, up_bias = (
            (None, None) if gate_up.bias is None else gate_up.bias.detach().chunk(2, dim=0)
        )
        self.gate_bias, self.up_bias = gate_bias, up_bias
        few_gate, few_up = few_row_view(gate, self.gate), few_row_view(up, self.up)
        self.few_rows = None if few_gate is None or few_up is None else (few_gate, few_up)
        """Our few-row kernel's views of ``gate`` and ``up`` for the batches it ``takes``, with
        the same epilogues, or None."""

    @property
    def num_weights(self) -> int:
        """Parameters of the plain gate and up weights together."""
        return 2 * self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows is not None and self.few_rows[0].takes(x):
            few_gate, few_up = self.few_rows
            gate = few_gate.linear(x, self.gate_bias, "silu")
            return few_up.linear(x, self.up_bias, "mul", gate)
        gate = torch.ops.mkldnn._linear_pointwise(x, self.gate, self.gate_bias, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.up, self.up_bias, "mul")

    def gate_and_up(self, x: torch.Tensor) -> torch.Tensor:
        """The product before the activation, ``[num_rows, 2 * intermediate]`` (gate, then up):
        what a LoRA adapter adds its deltas to (``lora.py``)."""
        if self.few_rows is not None and self.few_rows[0].takes(x):
            few_gate, few_up = self.few_rows
            parts = [few_gate.linear(x, self.gate_bias), few_up.linear(x, self.up_bias)]
        else:
            parts = [
                torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
                for weight, bias in ((self.gate, self.gate_bias), (self.up, self.up_bias))
            ]
        return torch.cat(parts, dim=-1)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, packed, silu"
            f"{few_row_label(None if self.few_rows is None else self.few_rows[0])}"
        )


def packing_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when ``pack_linears`` would pack for this device and dtype, else why not."""
    if device.type != "cpu":
        return f"{device.type} device (oneDNN packing is for the CPU)"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} (packing is used for bfloat16 and float32 only)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bfloat16 kernels for this CPU"
    return None


def pack_linears(
    model: nn.Module, device: torch.device, dtype: torch.dtype, *, silu_gate_up: bool = True
) -> int:
    """Replaces every ``nn.Linear`` of ``model`` with a ``PackedLinear`` (a ``gate_up_proj`` with
    a ``PackedSiluGateUp`` where ``silu_gate_up``: a SwiGLU MLP's, not Gemma's GeGLU) when this
    device and dtype pack (see the module docstring); returns how many were packed."""
    reason = packing_unavailable_reason(device, dtype)
    if reason is not None:
        logger.info("linear weights stay in the plain layout: %s", reason)
        return 0
    embedding_weights = {
        id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)
    }
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and not (dtype == torch.float32 and id(child.weight) in embedding_weights)
    ]
    if not targets:  # a GGUF file's projections hold codes (gguf_linear.py), its lm_head tied
        logger.info("no linear weight left in the plain layout to pack")
        return 0
    few_rows = 0
    with torch.no_grad():
        for parent, name, child in targets:
            fused = silu_gate_up and name == "gate_up_proj"
            packed = PackedSiluGateUp(child) if fused else PackedLinear(child)
            few_rows += packed.few_rows is not None
            setattr(parent, name, packed)
    if dtype == torch.bfloat16:
        kernel, why = "the AMX kernel", amx_linear.amx_unavailable_reason()
        limit = amx_linear.MAX_ROWS
    else:
        kernel, why = "the fp32 few-row kernel", fp32_linear.fp32_linear_unavailable_reason()
        limit = 0 if why else fp32_linear.MAX_ROWS[resolve_isa()]
    if few_rows:
        note = f"{few_rows} of them take batches of up to {limit} rows on {kernel}"
    else:
        note = f"none runs on {kernel} ({why or 'oneDNN packed them in another layout'})"
    logger.info("packed %d linear weights into oneDNN's blocked layout; %s", len(targets), note)
    return len(targets)
