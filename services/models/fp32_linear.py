"""fp32 linears of few rows on the vector units, reading the weight oneDNN packed.

Why: in fp32 (what ``--dtype auto`` picks on a CPU whose bf16 arithmetic is slow) a decode step's
linears are compute-bound at 64 rows, yet oneDNN's packed kernel runs them at about three quarters
of its cache-resident rate once the weights come from memory: its arithmetic and the weight stream
take turns. ``csrc/fp32_linear_kernel.h`` multiplies one 64-column panel of the weight by every row,
256 inputs at a time, while it prefetches the thread's next block into the L2, spread evenly over
the block's work, so that the stream runs under the arithmetic (``docs/benchmarks.md``, issue 21).
Where it is faster (``benchmarks/few_row_linear.py --dtype float32``, the small model's projections
streamed from memory, oneDNN held to the same instruction set): AVX-512 10-14 % at 1-64 rows, even
at 128 (before the twenty-third pass's unrolling and blocking; not measured since). AVX2 depends on
the core (each host with its wider instructions switched off): on the Intel host of the sixth pass
of ``docs/benchmarks.md`` 23-40 % at 1-24 rows, 3 % at 48, 5 % slower at 64 and 20 % at 128; on the
AMD EPYC (Zen 4) host of its nineteenth pass, three runs, 15-28 % at 1 row, 8-13 % at 48, 4-8 % at
64, 3 % slower to 1 % faster at 80 and equal or 5 % slower at 96, and a decode step of 64 sequences
ran 3-5 % faster with the kernel than on oneDNN; on a real AVX2-only AMD EPYC (Zen 3, 512 KiB L2;
twenty-third pass), after the kernel was unrolled and blocked by 256 inputs for that L2, 66-77 % at
16 rows, 17-19 % at 64, 3-9 % at 80, 2 % slower to 1 % faster at 96. The AVX2-only servers in use
are mostly AMD's (Zen 2 and 3, whose vector units are Zen 4's at 256 bits), so AVX2's limit is 64
rows. Hence ``MAX_ROWS``; and a weight stays on oneDNN where its panels do not give every thread two
(``Fp32FewRowWeight.takes``).

It reads the very buffer ``mkldnn._reorder_linear_weight`` made: oneDNN packs an fp32 linear
weight for its AVX2 and AVX-512 kernels as ``[out/64][in][64]``, each panel's 64 output columns
contiguous for every input, which is the layout this kernel wants, so the model keeps one copy
of its weights and larger batches (prefill) still run oneDNN's kernel. That layout is oneDNN's
choice, not a promise: ``Fp32FewRowWeight.of`` compares every packed float with the plain weight
before it lets the kernel read them, and a weight packed any other way (another oneDNN version or
CPU, an output width that is not a multiple of 64, an input width that is not one of 16) stays on
oneDNN alone.

Life cycle: as ``amx_linear.FewRowWeight``'s: made once per weight while ``pack_linears`` packs
it; holds the packed tensor whose buffer the kernel reads; each ``linear`` call runs on the
calling thread's torch OpenMP pool and allocates its output.

On by default where the native kernels build and their variant is AVX2 or better (the portable
one was not measured against oneDNN); ``PDSERVE_FP32_LINEAR=0`` turns it off (to measure oneDNN
alone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Self

import torch

from services.models.amx_linear import Epilogue
from services.models.cpu_features import cpu_flags
from services.models.native_build import UnsupportedIsaError, native_kernel_error, resolve_isa
from services.models.onednn_packing import packed_buffer, verified_address

MAX_ROWS = {"avx512_bf16": 64, "avx512": 64, "avx2": 64}
"""Per kernel variant, batches up to this many rows take this kernel, larger ones oneDNN's (see
the module docstring for where each is faster)."""

SWITCH_ENV = "PDSERVE_FP32_LINEAR"
"""``0`` keeps every fp32 linear on oneDNN."""

PANEL = 64
"""Output columns of one of oneDNN's fp32 weight panels."""


def fp32_linear_unavailable_reason() -> str | None:
    """None when this process runs the fp32 few-row kernel, else why not (never raises)."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return f"{SWITCH_ENV}=0"
    missing = sorted({"avx2", "fma"} - cpu_flags())
    if missing:  # told without building the native kernels
        return f"this CPU lacks {', '.join(missing)}"
    error = native_kernel_error()
    if error is not None:
        return f"native CPU kernels are unavailable: {error}"
    try:
        isa = resolve_isa()
    except UnsupportedIsaError as exc:  # PDSERVE_NATIVE_ISA names one this CPU cannot run
        return str(exc)
    if isa not in MAX_ROWS:
        return f"the {isa} variant (it runs on AVX2 or AVX-512)"
    return None


def _in_panel_layout(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether ``packed`` holds the ``[out, in]`` fp32 ``weight`` as ``[out/64][in][64]``
    exactly (compared as bits, so NaNs compare too)."""
    out_features, in_features = weight.shape
    if out_features % PANEL:
        return False
    flat = packed_buffer(packed, torch.int32)
    if flat.numel() != weight.numel():
        return False
    # weight[64 p + c, k] sits at [p][k][c].
    expected = weight.view(torch.int32).view(out_features // PANEL, PANEL, in_features)
    return torch.equal(flat.view(out_features // PANEL, in_features, PANEL),
                       expected.transpose(1, 2))  # fmt: skip


@dataclass(frozen=True)
class Fp32FewRowWeight:
    """A oneDNN-packed fp32 weight the fp32 few-row kernel reads, with what it needs to call
    it. ``bf16_linear.Bf16FewRowWeight`` is the same for bf16, through the class hooks below
    (``OP``, ``DTYPE``, ``unavailable_reason``, ``in_layout``, ``variant``)."""

    OP: ClassVar[str] = "fp32_linear"
    """The op of ``torch.ops.pdserve`` that ``linear`` calls."""
    DTYPE: ClassVar[torch.dtype] = torch.float32
    """The weights (and rows) it multiplies."""

    packed: torch.Tensor
    """The ``mkldnn`` tensor whose buffer the kernel reads (held so that it stays allocated)."""
    address: int
    in_features: int
    out_features: int
    isa: str
    """The kernel variant (``native_build.resolve_isa`` at packing time)."""

    @classmethod
    def of(cls, weight: torch.Tensor, packed: torch.Tensor) -> Self | None:
        """The kernel's view of ``packed`` (made from the plain ``weight``), or None where the
        kernel does not run here or oneDNN packed it in another layout."""
        if weight.dtype != cls.DTYPE or cls.unavailable_reason() is not None:
            return None
        address = verified_address(weight, packed, cls.in_layout)
        if address is None:
            return None
        out_features, in_features = weight.shape
        return cls(packed, address, in_features, out_features, cls.variant())

    @staticmethod
    def unavailable_reason() -> str | None:
        """None when this process runs the kernel, else why not."""
        return fp32_linear_unavailable_reason()

    @staticmethod
    def in_layout(weight: torch.Tensor, packed: torch.Tensor) -> bool:
        """Whether ``packed`` holds ``weight`` in the layout the kernel reads."""
        return _in_panel_layout(weight, packed)

    @staticmethod
    def variant() -> str:
        """The kernel variant a new view runs."""
        return resolve_isa()

    @property
    def max_rows(self) -> int:
        """The largest batch this kernel multiplies (``MAX_ROWS`` of its variant)."""
        return MAX_ROWS[self.isa]

    def takes(self, x: torch.Tensor) -> bool:
        """Whether this kernel, rather than oneDNN's, multiplies this batch of rows: up to
        ``max_rows`` rows, and while every thread gets two 64-column panels or more. The kernel
        splits the panels over the threads and hides the stream of a thread's next panel under
        its current one, so a thread with one panel has nothing to hide it under, and a thread
        with none waits (on many cores a narrow projection stays on oneDNN, which splits rows
        too; the row limits were measured with two threads)."""
        panels = self.out_features // PANEL
        return (
            x.dim() == 2 and x.shape[0] <= self.max_rows and panels >= 2 * torch.get_num_threads()
        )

    def linear(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        epilogue: Epilogue = "none",
        other: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``epilogue(x @ weight.T + bias)`` for ``x`` ``[num_rows, in_features]`` in the
        weight's dtype; ``mul`` multiplies by ``other`` ``[num_rows, out_features]``."""
        return getattr(torch.ops.pdserve, self.OP)(
            x.contiguous(),
            self.address,
            self.in_features,
            self.out_features,
            bias,
            epilogue,
            other,
            self.isa,
        )
