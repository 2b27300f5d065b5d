"""Decoder projections that keep their weights in fp8 and multiply in fp8 (``torch._scaled_mm``).

Why: fp8 weights take half a bf16 model's memory, a decode step streams them in half the time,
and a prefill step multiplies them on the fp8 tensor cores. Each call quantizes its input per
row (a token's largest magnitude onto ``FP8_MAX``, vLLM's dynamic per-token scheme), or by the
checkpoint's static ``input_scale``, multiplies the two fp8 matrices with unit scales
(accumulating in fp32), and scales the sums by each row's and each weight row's scale:
``out[t, o] = (sum_i q_x[t, i] q_w[o, i]) * s_x[t] * s_w[o]``. On a GPU those are three
kernels: the quantization and the scaling in Triton (``triton_fp8_quant``), the GEMM cuBLASLt's
per-tensor one. torch's GEMM with a scale per row and per column, one kernel, ran 1.4-2.7x slower
than it on an H200 at decode batches (8.1 against 4.1 us for 1 x 2,048 by 2,048 x 3,072; 21.5
against 8.0 us for 1 x 8,192 by 8,192 x 2,048). As built, a 1B model's decode step takes
bf16's time there (the two ~2-3 us kernels around each GEMM cost what its halved bytes save),
and its prefill steps run faster (offline 1.80x; ``docs/benchmarks.md``). Nothing here syncs
with the host, so a decode step with these projections is captured in CUDA graphs like any
other.

Life cycle: ``install_fp8_linears`` runs on the model built on the meta device, before its
memory is allocated (so a 16-bit copy of the weights is never made); the loader then fills
each module's fp8 rows and row scales (``fill``) from a checkpoint's fp8 weights or by
quantizing a 16-bit checkpoint's (``fp8_checkpoint.quantize_rows``). Nothing changes them
afterwards. The embedding and the lm_head stay in the compute dtype, as in vLLM.

Where it runs: ``torch._scaled_mm`` needs a GPU of compute capability 8.9 or later (Ada,
Hopper, Blackwell) or a CPU (correct there, and used by the suite, but several times slower
than the 16-bit path: ``fp8_gemm_unavailable_reason``, ``choose_fp8_linears``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.models.fp8_checkpoint import FP8_MAX, Fp8Checkpoint, QuantizedWeight
from services.types import EngineConfigError

_FP8 = torch.float8_e4m3fn
_CUDA_ALIGNMENT = 16
"""cuBLASLt's fp8 GEMM takes inner and outer sizes that are multiples of 16."""


def fp8_gemm_unavailable_reason(device: torch.device) -> str | None:
    """None where ``torch._scaled_mm`` multiplies fp8 on ``device``, else why not."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"{device.type} device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} (fp8 GEMMs need 8.9 or later)"
    return None


class Fp8Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` held as fp8 rows and a float32 scale per row."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # Parameters (not buffers) so that the loader finds them by name; never trained.
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=_FP8), False)
        self.weight_scale = nn.Parameter(torch.empty(out_features), False)
        """float32 ``[out]``: row o of the weight is ``weight[o] * weight_scale[o]``."""
        self.bias = nn.Parameter(torch.empty(out_features), False) if bias else None
        self.register_buffer("_one", torch.empty(()), persistent=False)
        """1.0, the GEMM's unit scale (``fill`` sets it: the module is built on the meta device
        and its memory allocated uninitialized); a buffer, so that it moves with the module."""
        self.input_scale: float | None = None
        """The checkpoint's static input scale (the largest of the projections fused here), or
        None: each call scales each row of its input by that row's largest magnitude."""

    def fill(self, row: int, weight: QuantizedWeight) -> None:
        """Write ``weight``'s rows from row ``row`` on (a fused projection takes several)."""
        count = weight.values.shape[0]
        self._one.fill_(1.0)
        self.weight.data.narrow(0, row, count).copy_(weight.values)
        self.weight_scale.data.narrow(0, row, count).copy_(weight.row_scales)
        if weight.input_scale is not None:
            self.input_scale = max(self.input_scale or 0.0, weight.input_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] in the compute dtype → [rows, out_features], same dtype."""
        rows = x.shape[0]
        if rows == 0:
            return x.new_empty(0, self.out_features)
        if x.is_cuda:
            from services.models import triton_fp8_quant

            q, x_scale = triton_fp8_quant.quantize_input_triton(x.contiguous(), self.input_scale)
            raw = torch._scaled_mm(
                q, self.weight.t(), scale_a=self._one, scale_b=self._one, out_dtype=torch.bfloat16
            )
            return triton_fp8_quant.scale_output_triton(
                raw, x_scale, self.weight_scale, self.bias, x.dtype
            )
        q, x_scale = quantize_input_torch(x, self.input_scale)
        raw = torch._scaled_mm(
            q, self.weight.t(), scale_a=self._one, scale_b=self._one, out_dtype=torch.float32
        )
        out = (raw * x_scale * self.weight_scale).to(x.dtype)
        if self.bias is not None:
            out += self.bias
        return out

    def extra_repr(self) -> str:
        scheme = "dynamic" if self.input_scale is None else f"static {self.input_scale:.3g}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fp8 weights, {scheme} input scales"
        )


def quantize_input_torch(
    x: torch.Tensor, static_scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, cols] → (float8_e4m3fn [rows, cols], float32 [rows, 1] scales): each row by
    its largest magnitude over ``FP8_MAX``, or every row by ``static_scale``. The CPU's path;
    ``triton_fp8_quant`` does the same in one kernel on a GPU."""
    if static_scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min_(1e-12) / FP8_MAX
    else:
        scale = torch.full((x.shape[0], 1), static_scale, device=x.device)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(_FP8), scale


_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
"""Our fused projections of a decoder layer → the checkpoint's modules each holds."""


def install_fp8_linears(
    model: nn.Module, scheme: Fp8Checkpoint | None, device: torch.device
) -> int:
    """Replaces each decoder projection of ``model`` (a ``LlamaForCausalLM`` on the meta device)
    with an ``Fp8Linear``, except where ``scheme`` leaves one of the checkpoint's modules it
    holds in 16 bits, or where the GPU's GEMM cannot take its sizes; returns how many."""
    count = 0
    for index, layer in enumerate(model.model.layers):  # type: ignore[union-attr]
        for ours, theirs in _PROJECTIONS.items():
            parent_name, attr = ours.split(".")
            parent = getattr(layer, parent_name)
            linear = getattr(parent, attr)
            prefix = f"model.layers.{index}"
            if scheme is not None and any(scheme.is_ignored(f"{prefix}.{m}") for m in theirs):
                continue
            sizes = (linear.in_features, linear.out_features)
            if device.type == "cuda" and any(size % _CUDA_ALIGNMENT for size in sizes):
                continue
            with torch.device("meta"):
                fp8 = Fp8Linear(*sizes, bias=linear.bias is not None)
            if fp8.bias is not None:
                fp8.bias.data = fp8.bias.data.to(linear.bias.dtype)
            setattr(parent, attr, fp8)
            count += 1
    return count


@dataclass(frozen=True)
class Fp8Choice:
    """Whether the decoder's projections multiply in fp8, and why."""

    on: bool
    why: str

    def describe(self) -> str:
        return f"{'fp8' if self.on else 'the compute dtype'} ({self.why})"


def choose_fp8_linears(
    quantization: str | None, scheme: Fp8Checkpoint | None, device: torch.device
) -> Fp8Choice:
    """``quantization="fp8"`` asks for fp8 GEMMs (``EngineConfigError`` where the device has
    none); without it an fp8 checkpoint gets them where they are faster than dequantizing it,
    on a GPU that has them, and only for the schemes ``Fp8Linear`` computes exactly (one scale
    per weight row, activations quantized)."""
    unavailable = fp8_gemm_unavailable_reason(device)
    if quantization == "fp8":
        if unavailable is not None:
            raise EngineConfigError(f"quantization fp8: no fp8 GEMM on {device} ({unavailable})")
        why = "quantization fp8" + ("" if scheme else ", quantized per row")
        if device.type == "cpu":
            # Measured on a quiet 2-core AMD EPYC, one projection of 768 x 2,304: one row 9.0
            # ms in fp8 against 0.20 in fp32, 64 rows 16.1 against 1.9, 512 rows 28.3 against
            # 12.3.
            why += "; on a CPU correct but several times slower than the 16-bit path"
        return Fp8Choice(True, why)
    if scheme is None:
        return Fp8Choice(False, "unquantized checkpoint")
    if scheme.block is not None:
        return Fp8Choice(False, "block-scaled fp8 checkpoint, dequantized: no block GEMM built")
    if scheme.activations == "none":
        return Fp8Choice(False, "weight-only fp8 checkpoint, dequantized")
    if device.type == "cpu":
        return Fp8Choice(False, "fp8 checkpoint on CPU, dequantized: fp8 GEMMs are no faster")
    if unavailable is not None:
        return Fp8Choice(False, f"fp8 checkpoint dequantized: {unavailable}")
    return Fp8Choice(True, "fp8 checkpoint")
