"""The decoder's elementwise steps as one Triton kernel each (GPU path): ``LayerOps`` fused.

Why: on an H200 a graphed decode step of the small model replayed in 0.76 ms against a
0.05 ms byte floor, ~320 kernels a step (profiled), three quarters of them elementwise, copies
and gathers: launch and tail latency, not bytes. torch runs a layer's two
RMSNorms with their residual adds as three kernels each, rotary as five per tensor, SiLU-and-mul
as two; here each is one (vLLM's fused_add_rms_norm, rotary_embedding and silu_and_mul), about
14 kernels fewer a layer.

Numbers as ``LayerOps`` gives them, with transformers' roundings: rotary the same bits (each
product rounded to the activations' dtype, then the sum, as torch's ops do); the residual add
the same bits; RMSNorm and SiLU within one rounding of the dtype (another summation order,
another ``exp``).

Rows are tokens; one program per token (and, for rotary, per head of the query then the key).
``hidden_size``, ``head_dim`` and the intermediate size need not be powers of two: blocks are
masked. Testing without a GPU: under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors
(``tests/models/test_triton_layer_ops.py``), and ``triton_compile`` builds them for sm_90.
On by default on a GPU (``PDSERVE_TRITON_LAYER_OPS``, ``backends.make_layer_ops``), where an
H200 ran their ``gpu`` tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.models.layer_ops import LayerOps
from services.models.rotary import RopeTables


@triton.jit
def _add_rms_norm_kernel(
    out_ptr,
    hidden_ptr,
    pending_ptr,
    weight_ptr,
    hidden_size,
    eps,
    HAS_PENDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``pid``: hidden += pending (in place, rounded to the dtype), then out = weight *
    round(hidden * rsqrt(mean(hidden^2) + eps)), the norm in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(hidden_ptr + row * hidden_size + cols, mask=mask, other=0.0)
    if HAS_PENDING:
        p = tl.load(pending_ptr + row * hidden_size + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + p.to(tl.float32)).to(x.dtype)
        tl.store(hidden_ptr + row * hidden_size + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden_size
    normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * hidden_size + cols, out, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
):
    """Program (token, head): heads [0, num_heads) are the query's, the rest the key's, rotated
    in place: x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    cols = tl.arange(0, HALF_BLOCK)
    mask = cols < half
    if head < num_heads:
        base = q_ptr + token * stride_q_tok + head * stride_q_head
    else:
        base = k_ptr + token * stride_k_tok + (head - num_heads) * stride_k_head
    x1 = tl.load(base + cols, mask=mask, other=0.0)
    x2 = tl.load(base + half + cols, mask=mask, other=0.0)
    # cos and sin rows repeat their first half (emb = cat(freqs, freqs)): one half is enough.
    cos = tl.load(cos_ptr + token * HEAD_DIM + cols, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * HEAD_DIM + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # out[:half] = x1 * cos + (-x2) * sin; out[half:] = x2 * cos + x1 * sin
    lo = ((a1 * cos).to(dtype).to(tl.float32) + (-a2 * sin).to(dtype).to(tl.float32)).to(dtype)
    hi = ((a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + cols, lo, mask=mask)
    tl.store(base + half + cols, hi, mask=mask)


@triton.jit
def _silu_and_mul_kernel(out_ptr, gate_up_ptr, intermediate, BLOCK: tl.constexpr):
    """Program (row, block of columns): out = round(silu(gate)) * up, rounded, as torch's two
    ops round."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(gate_up_ptr + row * 2 * intermediate + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * intermediate + intermediate + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * intermediate + cols, out, mask=mask)


_SILU_BLOCK = 1024

ROTARY_OPTIONS = {"enable_fp_fusion": False}
"""Rotary's compile options. With fusion on, sm_90's compiler turns ``round(a * cos) + b`` into
one ``fma.rn.bf16`` (the product not rounded) and the result leaves torch's bits by an ulp, as
an H200 showed; without it each product is its own ``mul.rn.bf16``."""


def norm_num_warps(block: int) -> int:
    """Warps for a row of ``block`` columns: 4 up to 2,048 (at most 16 values a thread), more
    for wider rows, so that a thread holds at most 32 of an 8,192-wide row (Llama-3-70B)."""
    return max(4, min(16, block // 512))


class TritonLayerOps(LayerOps):
    """``LayerOps`` with RMSNorm (and its residual add), rotary and SiLU-and-mul as one Triton
    kernel each; the greedy argmax stays torch's."""

    def describe(self) -> str:
        return "triton (fused add-RMSNorm, rotary, SiLU-and-mul)"

    def rms_norm(
        self, hidden: torch.Tensor, pending: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        num_tokens, hidden_size = hidden.shape
        assert hidden.is_contiguous() and (pending is None or pending.is_contiguous())
        out = torch.empty_like(hidden)
        block = triton.next_power_of_2(hidden_size)
        if num_tokens:
            _add_rms_norm_kernel[(num_tokens,)](
                out,
                hidden,
                hidden if pending is None else pending,
                weight,
                hidden_size,
                eps,
                HAS_PENDING=pending is not None,
                BLOCK=block,
                num_warps=norm_num_warps(block),
            )
        return out

    def rotary(
        self, query: torch.Tensor, key: torch.Tensor, rope: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place on ``query`` and ``key`` (views of the QKV output, rows strided); returns
        them."""
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        assert query.stride(2) == 1 and key.stride(2) == 1
        cos = rope.cos.reshape(num_tokens, head_dim)  # [num_tokens, head_dim], the dtype
        sin = rope.sin.reshape(num_tokens, head_dim)
        assert cos.is_contiguous() and sin.is_contiguous()
        if num_tokens:
            _rotary_kernel[(num_tokens, num_heads + num_kv_heads)](
                query,
                key,
                cos,
                sin,
                query.stride(0),
                query.stride(1),
                key.stride(0),
                key.stride(1),
                num_heads,
                HEAD_DIM=head_dim,
                HALF_BLOCK=triton.next_power_of_2(head_dim // 2),
                **ROTARY_OPTIONS,
            )
        return query, key

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        num_tokens, width = gate_up.shape
        intermediate = width // 2
        assert gate_up.is_contiguous()
        out = gate_up.new_empty(num_tokens, intermediate)
        if num_tokens:
            grid = (num_tokens, triton.cdiv(intermediate, _SILU_BLOCK))
            _silu_and_mul_kernel[grid](out, gate_up, intermediate, BLOCK=_SILU_BLOCK)
        return out
