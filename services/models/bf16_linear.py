"""bf16 linears of few rows on ``vdpbf16ps``, reading the weight oneDNN packed (CPUs with
AVX512-BF16 and no AMX).

Why: on such a CPU (the AMD EPYC host of ``docs/benchmarks.md``) bf16 is the faster dtype and a
decode step's linears are compute-bound at 64 rows, yet oneDNN's packed kernel runs them below
its cache-resident rate once the weights come from memory, and far below it at a few rows
(``benchmarks/few_row_linear.py``, the small model's projections streamed from memory, two
threads: 1.37x oneDNN's rate at 1 row, 1.32x at 16, 1.11-1.12x at 32 and 64, 1.04x at 96, equal
at 128). ``csrc/bf16_linear_avx512_bf16.cpp`` is the fp32 few-row kernel's structure
(``fp32_linear.py``) on ``vdpbf16ps``: one 64-column panel by every row while the thread's next
panel is prefetched into the L2. Hence ``MAX_ROWS``. In the engine, one sequence decoded at
94-116 against 70-82 output tok/s, eight at 485-528 against 413-465 (``offline_throughput.py``).

It reads the very buffer ``mkldnn._reorder_linear_weight`` made: on a CPU with AVX512-BF16 and
no AMX, oneDNN packs a bf16 linear weight as ``[out/64][in/2][64][2]``, each panel's 64 output
columns contiguous for every pair of inputs, which is what ``vdpbf16ps`` multiplies, so the model
keeps one copy of its weights and larger batches (prefill) still run oneDNN's kernel. That
layout is oneDNN's choice, not a promise: ``Bf16FewRowWeight.of`` compares every packed element
with the plain weight before it lets the kernel read them; a weight packed any other way (an AMX
CPU's tile layout, which ``amx_linear.py`` reads instead, another oneDNN version, an output width
that is not a multiple of 64 or an input width that is not one of 32) stays on oneDNN alone.

Life cycle: as ``fp32_linear.Fp32FewRowWeight``'s: made once per weight while ``pack_linears``
packs it; holds the packed tensor whose buffer the kernel reads; each ``linear`` call runs on the
calling thread's torch OpenMP pool and allocates its output.

On by default where the native kernels build and their variant is avx512_bf16;
``PDSERVE_BF16_LINEAR=0`` turns it off (to measure oneDNN alone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from services.models.cpu_features import cpu_flags
from services.models.fp32_linear import PANEL, Fp32FewRowWeight
from services.models.native_build import (
    KERNEL_ISAS,
    UnsupportedIsaError,
    native_kernel_error,
    resolve_isa,
)
from services.models.onednn_packing import packed_buffer

MAX_ROWS = 96
"""Batches up to this many rows take this kernel, larger ones oneDNN's (equal at 128 rows)."""

SWITCH_ENV = "PDSERVE_BF16_LINEAR"
"""``0`` keeps every bf16 linear of a CPU without AMX on oneDNN."""

ISA = "avx512_bf16"
"""The kernel's one variant."""


def bf16_linear_unavailable_reason() -> str | None:
    """None when this process runs the bf16 few-row kernel, else why not (never raises)."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return f"{SWITCH_ENV}=0"
    missing = sorted(KERNEL_ISAS[ISA] - cpu_flags())
    if missing:  # told without building the native kernels
        return f"this CPU lacks {', '.join(missing)}"
    error = native_kernel_error()
    if error is not None:
        return f"native CPU kernels are unavailable: {error}"
    try:
        isa = resolve_isa()
    except UnsupportedIsaError as exc:  # PDSERVE_NATIVE_ISA names one this CPU cannot run
        return str(exc)
    if isa != ISA:
        return f"the {isa} variant is forced (the kernel is {ISA}'s)"
    return None


def _in_pair_panel_layout(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether ``packed`` holds the ``[out, in]`` bf16 ``weight`` as ``[out/64][in/2][64][2]``
    exactly (compared as bits, so NaNs compare too)."""
    out_features, in_features = weight.shape
    if out_features % PANEL or in_features % 2:
        return False
    flat = packed_buffer(packed, torch.int16)
    if flat.numel() != weight.numel():
        return False
    # weight[64 p + c, 2 k + e] sits at [p][k][c][e].
    expected = weight.view(torch.int16).view(out_features // PANEL, PANEL, in_features // 2, 2)
    got = flat.view(out_features // PANEL, in_features // 2, PANEL, 2)
    return torch.equal(got, expected.transpose(1, 2))


@dataclass(frozen=True)
class Bf16FewRowWeight(Fp32FewRowWeight):
    """A oneDNN-packed bf16 weight the bf16 few-row kernel reads; which batches it ``takes`` is
    the fp32 kernel's rule (the same panels over the threads), up to ``MAX_ROWS`` rows, and
    ``linear`` calls the bf16 op with the same arguments."""

    OP: ClassVar[str] = "bf16_linear"

    DTYPE: ClassVar[torch.dtype] = torch.bfloat16

    @staticmethod
    def unavailable_reason() -> str | None:
        return bf16_linear_unavailable_reason()

    @staticmethod
    def in_layout(weight: torch.Tensor, packed: torch.Tensor) -> bool:
        return _in_pair_panel_layout(weight, packed)

    @staticmethod
    def variant() -> str:
        return ISA

    @property
    def max_rows(self) -> int:
        return MAX_ROWS
