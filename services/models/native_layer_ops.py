"""``LayerOps`` on the fused native CPU kernels (``csrc/fused_ops*.cpp``).

One pass over memory per step instead of torch's 3-8 elementwise ops, each widening bf16 to fp32
and rounding back: RMSNorm with its residual add, rotary in place on the fused QKV output, and
SiLU-and-mul. The greedy argmax is one vectorised pass per row where torch's ``max(dim)`` took
0.57 ms for 64 x 32,000 fp32 logits and 2.7 ms for 64 x 151,936 (Qwen's vocabulary). The same
variant rules as the attention kernel (``native_build.py``). A tensor the kernels do not take
(another dtype or device, a strided hidden state: Qwen3's per-head norms take the torch module,
not this) goes to the torch implementation.
"""

from __future__ import annotations

import torch

from services.models.layer_ops import LayerOps
from services.models.native_build import native_kernel_error, resolve_isa
from services.models.rotary import RopeTables

_DTYPES = (torch.float32, torch.bfloat16)


class NativeLayerOps(LayerOps):
    def __init__(self, isa: str | None = None) -> None:
        self.isa = resolve_isa(isa)
        """The kernel variant these ops run (see ``native_build.resolve_isa``)."""
        error = native_kernel_error()
        if error is not None:
            raise RuntimeError(f"native CPU kernels are unavailable: {error}")

    def describe(self) -> str:
        return f"native fused kernels ({self.isa})"

    @staticmethod
    def _takes(t: torch.Tensor) -> bool:
        """The model's activations decide: its weights and tables share their dtype and device
        (the ops check every argument and raise if not)."""
        return t.device.type == "cpu" and t.dtype in _DTYPES

    def rms_norm(
        self, hidden: torch.Tensor, pending: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if not (self._takes(hidden) and hidden.dim() == 2 and hidden.is_contiguous()):
            return super().rms_norm(hidden, pending, weight, eps)
        if pending is not None:
            pending = pending.contiguous()
        out = torch.empty_like(hidden)
        torch.ops.pdserve.rms_norm(hidden, pending, weight, eps, out, self.isa)
        return out

    def rotary(
        self, query: torch.Tensor, key: torch.Tensor, rope: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._takes(query):
            return super().rotary(query, key, rope)
        # In place: query and key are views of the fused QKV output, rows strided, heads
        # contiguous (or Qwen3's normed copies); the op refuses any other layout.
        torch.ops.pdserve.rotary_(query, key, rope.cos, rope.sin, self.isa)
        return query, key

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not (self._takes(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous()):
            return super().silu_and_mul(gate_up)
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        torch.ops.pdserve.silu_and_mul(out, gate_up, self.isa)
        return out

    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if not (self._takes(logits) and logits.dim() == 2 and logits.shape[1] > 0):
            return super().greedy_argmax(logits)
        return torch.ops.pdserve.argmax_rows(logits.contiguous(), self.isa)
