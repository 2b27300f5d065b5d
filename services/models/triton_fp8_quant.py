"""An fp8 projection's input quantized, and its output scaled, in one Triton kernel each (GPU
path of ``fp8_linear``).

Why: in torch ops, quantizing the input per row takes nine kernels (abs, amax, the float casts,
the divisions, clamp, the fp8 cast). On an H200 a graphed decode step of the ~1B model with
fp8 projections took 2.6 ms against bf16's 1.25 at one sequence: about 20 us more for each of
the 64 projections, the length of nine small kernels in a replayed graph. Here it is one.

Numbers as the torch path gives them (``fp8_linear.quantize_input_torch``): the row's largest
magnitude (exact in any dtype), its scale ``max(amax, 1e-12) / FP8_MAX`` in float32, each value
divided in float32 (IEEE division, as torch's), clamped to +-FP8_MAX and rounded to
nearest-even e4m3; with a static scale, every row by it. One program per row; a row of up to
16,384 values is held whole (wider ones loop). The GEMM between them multiplies the fp8 values
with unit scales (cuBLASLt's per-tensor kernel: torch's row-scaled one ran 1.4-2.7x slower on
an H200 at decode sizes, ``fp8_linear``), and ``_scale_output_kernel`` applies each row's and
each column's scale, and the bias, to its sums. Testing without a GPU: under
``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (``tests/models/test_fp8.py``), and
``triton_compile`` builds it for sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.models.fp8_checkpoint import FP8_MAX

_MAX_BLOCK = 16384
"""Columns a program holds at once: Llama-3-70B's 28,672-wide MLP input takes two passes."""


@triton.jit
def _quantize_rows_kernel(
    q_ptr,
    scale_ptr,
    x_ptr,
    cols,
    static_scale,
    fp8_max,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``pid`` of ``x`` [rows, cols] → fp8 ``q`` [rows, cols] and float32 ``scale`` [rows]."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    if STATIC:
        scale = static_scale
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            mask = start + offsets < cols
            x = tl.load(x_ptr + row * cols + start + offsets, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / fp8_max
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        mask = start + offsets < cols
        x = tl.load(x_ptr + row * cols + start + offsets, mask=mask, other=0.0)
        q = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -fp8_max, fp8_max)
        tl.store(q_ptr + row * cols + start + offsets, q.to(tl.float8e4nv), mask=mask)


@triton.jit
def _scale_output_kernel(
    out_ptr, raw_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, cols, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row, block of columns): out = raw * x_scale[row] * w_scale[col] (+ bias[col]),
    in float32, rounded to ``out``'s dtype once."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < cols
    raw = tl.load(raw_ptr + row * cols + offsets, mask=mask, other=0.0).to(tl.float32)
    w_scale = tl.load(w_scale_ptr + offsets, mask=mask, other=0.0)
    value = raw * tl.load(x_scale_ptr + row) * w_scale
    if HAS_BIAS:
        value += tl.load(bias_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * cols + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


SCALE_BLOCK = 1024


def scale_output_triton(
    raw: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``raw`` [rows, cols] (the GEMM's unscaled sums) times ``x_scale`` [rows, 1] and
    ``w_scale`` [cols], plus ``bias`` [cols]: [rows, cols] in ``dtype``."""
    rows, cols = raw.shape
    out = torch.empty(rows, cols, dtype=dtype, device=raw.device)
    _scale_output_kernel[(rows, triton.cdiv(cols, SCALE_BLOCK))](
        out,
        raw,
        x_scale,
        w_scale,
        raw if bias is None else bias,
        cols,
        HAS_BIAS=bias is not None,
        BLOCK=SCALE_BLOCK,
    )
    return out


def quantize_block(cols: int) -> int:
    """The kernel's ``BLOCK`` for rows of ``cols`` values."""
    return min(_MAX_BLOCK, triton.next_power_of_2(cols))


def quantize_num_warps(block: int) -> int:
    """4 warps up to 2,048 columns, up to 16 for wider rows (at most 32 values a thread)."""
    return max(4, min(16, block // 512))


def quantize_input_triton(
    x: torch.Tensor, static_scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, cols] (contiguous) → (float8_e4m3fn [rows, cols], float32 [rows, 1])."""
    rows, cols = x.shape
    assert x.is_contiguous()
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = quantize_block(cols)
    _quantize_rows_kernel[(rows,)](
        q,
        scale,
        x,
        cols,
        1.0 if static_scale is None else static_scale,
        FP8_MAX,
        STATIC=static_scale is not None,
        BLOCK=block,
        num_warps=quantize_num_warps(block),
    )
    return q, scale
