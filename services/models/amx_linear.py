"""bf16 linears of few rows on AMX tiles, reading the weight oneDNN packed.

Why: a decode step multiplies a few rows (one per sequence) by every weight of the model, so
its linears stream the weights from memory and do little arithmetic on each byte. oneDNN's AMX
kernel (what ``PackedLinear`` calls) streams them at about half this host's bandwidth at 64
rows. ``csrc/amx_linear_amx.cpp`` keeps four accumulator tiles busy per 32 output columns and
reads each weight byte once for every 32 rows (``docs/benchmarks.md``, issue 21).

It reads the very buffer ``mkldnn._reorder_linear_weight`` made: on AMX CPUs oneDNN packs bf16
linear weights as ``AB16b32a2b``, ``[out/32][in/32][16][32][2]``, which is the tile layout the
products need, so the model keeps one copy of its weights and larger batches (prefill) still run
oneDNN's kernel. That layout is oneDNN's choice, not a promise: ``FewRowWeight.of`` compares
every packed byte with the plain weight before it lets the kernel read them, and a weight packed
any other way (another oneDNN version or CPU, a padded shape) stays on oneDNN alone.

Life cycle: ``FewRowWeight.of`` runs once per weight while ``pack_linears`` packs it, while the
plain weight still exists; the result holds the packed tensor whose buffer the kernel reads, so
the buffer lives as long as the module that calls. Each ``linear`` call runs on the calling
thread's torch OpenMP pool and allocates its output.

On by default where the CPU has AMX-BF16 (and the kernel granted the tile-data permission);
``PDSERVE_AMX=0`` turns it off (to measure oneDNN alone), and with it the AMX products of the
native prefill attention (``native_attention.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from services.models.cpu_features import cpu_flags
from services.models.native_build import native_kernel_error
from services.models.onednn_packing import packed_buffer, verified_address

MAX_ROWS = 128
"""Batches up to this many rows take the AMX kernel, larger ones oneDNN's: on the 2-core host of
``docs/benchmarks.md`` ours is faster up to 128 rows and slower from 256 on (oneDNN blocks large
batches for the caches; this kernel reads every row for each 32 columns)."""

SWITCH_ENV = "PDSERVE_AMX"
"""``0`` keeps pdserve's own kernels off the AMX tiles: every linear on oneDNN, the prefill
attention's products on the vector units."""

Epilogue = Literal["none", "silu", "mul"]

_CPU_FLAGS = frozenset({"amx_bf16", "amx_tile", "avx512_bf16"})


def amx_unavailable_reason() -> str | None:
    """None when this process runs the AMX kernels, else why not (never raises). A CPU whose
    flags lack AMX is told so without building the native kernels (the op checks cpuid and the
    kernel's tile permission again)."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return f"{SWITCH_ENV}=0"
    missing = sorted(_CPU_FLAGS - cpu_flags())
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    error = native_kernel_error()
    if error is not None:
        return f"native CPU kernels are unavailable: {error}"
    return torch.ops.pdserve.amx_linear_unavailable_reason() or None


def _in_tile_layout(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether ``packed`` holds the ``[out, in]`` bf16 ``weight`` as
    ``[out/32][in/32][16][32][2]`` exactly (compared as bits, so NaNs compare too)."""
    out_features, in_features = weight.shape
    if out_features % 32 or in_features % 32:
        return False
    flat = packed_buffer(packed, torch.int16)
    if flat.numel() != weight.numel():
        return False
    # weight[32 b + o, 32 k + 2 p + e] sits at [b][k][p][o][e].
    expected = weight.view(torch.int16).view(out_features // 32, 32, in_features // 32, 16, 2)
    got = flat.view(out_features // 32, in_features // 32, 16, 32, 2)
    return torch.equal(got, expected.permute(0, 2, 3, 1, 4))


@dataclass(frozen=True)
class FewRowWeight:
    """A oneDNN-packed bf16 weight the AMX kernel reads, with what it needs to call it."""

    packed: torch.Tensor
    """The ``mkldnn`` tensor whose buffer the kernel reads (held so that it stays allocated)."""
    address: int
    in_features: int
    out_features: int

    @classmethod
    def of(cls, weight: torch.Tensor, packed: torch.Tensor) -> FewRowWeight | None:
        """The AMX view of ``packed`` (made from the plain ``weight``), or None where the kernel
        does not run here or oneDNN packed it in another layout."""
        if weight.dtype != torch.bfloat16 or amx_unavailable_reason() is not None:
            return None
        address = verified_address(weight, packed, _in_tile_layout)
        if address is None:
            return None
        out_features, in_features = weight.shape
        return cls(packed, address, in_features=in_features, out_features=out_features)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether the AMX kernel, rather than oneDNN's, multiplies this batch of rows."""
        return x.dim() == 2 and x.shape[0] <= MAX_ROWS

    def linear(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        epilogue: Epilogue = "none",
        other: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``epilogue(x @ weight.T + bias)`` for ``x`` ``[num_rows, in_features]`` bf16;
        ``mul`` multiplies by ``other`` ``[num_rows, out_features]``; rounded once to bf16."""
        return torch.ops.pdserve.amx_linear(
            x.contiguous(), self.address, self.in_features, self.out_features, bias, epilogue, other
        )
