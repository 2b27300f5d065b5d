"""The native CPU kernels' library: built once, one variant per instruction set, chosen at run
time.

One extension holds every native CPU op: the paged decode and prefill attention
(``csrc/paged_attention*.cpp``, ``csrc/prefill_attention*.cpp``, ``native_attention.py``), the
fused elementwise ops of a decoder layer (``csrc/fused_ops*.cpp``, ``native_layer_ops.py``) and
the few-row linears: bf16 on AMX (``csrc/amx_linear*.cpp``, ``amx_linear.py``: one variant, for
CPUs with AMX-BF16, which checks the CPU itself), bf16 on AVX512-BF16 (``csrc/bf16_linear*.cpp``,
``bf16_linear.py``: one variant), fp32 (``csrc/fp32_linear*.cpp``, ``fp32_linear.py``: its
AVX-512 variant also serves avx512_bf16) and over int8 codes (``csrc/quantized_linear.cpp``, its
variants compiled in the fp32 kernel's files; ``gguf_linear.py``). Each other kernel comes in one
variant per instruction set (``KERNEL_ISAS``: AVX512-BF16, AVX-512, AVX2 and a portable one),
compiled with per-file targets into one library with the baseline compiler flags, so the build
does not depend on the host. A user of the kernels runs the best variant this CPU supports
(``/proc/cpuinfo`` flags), or the one forced by its ``isa`` argument or ``PDSERVE_NATIVE_ISA``;
forcing one the CPU cannot run raises ``UnsupportedIsaError`` naming what is missing (every op
checks cpuid again: never SIGILL).

Life cycle: the extension is compiled on first use (``torch.utils.cpp_extension.load``, ~15-30 s,
most of it ``torch/library.h``), then cached under ``build_support.extensions_root()`` under a
name that hashes the sources; concurrent first builds from several processes wait on a lock
that a process killed mid-build does not leave behind (``build_support.load_extension``).
``native_kernel_error`` builds or loads it once per process and reports why it is unavailable
instead of raising, so ``backends.make_attention_backend("auto", ...)`` can fall back to the
torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from pathlib import Path

from kv_transfer.build_support import BuildOnce, build_error_summary, load_extension
from services.models.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

_EXTENSION_BASE_NAME = "pdserve_cpu_kernels"
_CSRC = Path(__file__).resolve().parent / "csrc"
_VARIANTS = ("_portable", "_avx2", "_avx512", "_avx512_bf16")
_SOURCES = [
    _CSRC / "cpu_isa.cpp",
    *(_CSRC / f"paged_attention{suffix}.cpp" for suffix in ("", *_VARIANTS)),
    *(_CSRC / f"prefill_attention{suffix}.cpp" for suffix in ("", *_VARIANTS, "_amx")),
    *(_CSRC / f"fused_ops{suffix}.cpp" for suffix in ("", *_VARIANTS)),
    _CSRC / "amx_linear.cpp",
    _CSRC / "amx_linear_amx.cpp",
    *(_CSRC / f"fp32_linear{suffix}.cpp" for suffix in ("", "_portable", "_avx2", "_avx512")),
    _CSRC / "quantized_linear.cpp",
    *(_CSRC / f"bf16_linear{suffix}.cpp" for suffix in ("", "_avx512_bf16")),
]
_HEADERS = [
    _CSRC / name
    for name in (
        "cpu_isa.h",
        "simd.h",
        "cache_type.h",
        "cache_dtype.h",
        "paged_attention_isa.h",
        "paged_attention_kernel.h",
        "prefill_attention_isa.h",
        "prefill_attention_kernel.h",
        "fused_ops_isa.h",
        "fused_ops_kernel.h",
        "amx_linear_isa.h",
        "linear_epilogue.h",
        "few_row_linear_args.h",
        "fp32_linear_isa.h",
        "fp32_linear_kernel.h",
        "quantized_linear_isa.h",
        "panel_prefetch.h",
        "bf16_linear_isa.h",
        "amx_tiles.h",
    )
]

ISA_ENV = "PDSERVE_NATIVE_ISA"
"""Forces a kernel variant for every ``NativePagedAttention`` of the process (tests, benchmarks)."""
KERNEL_ISAS: dict[str, frozenset[str]] = {
    "avx512_bf16": frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
    "avx512": frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}),
    "avx2": frozenset({"avx2", "fma"}),
    "portable": frozenset(),
}
"""Kernel variants, fastest first, each with the ``/proc/cpuinfo`` flags it needs."""


class UnsupportedIsaError(ValueError):
    """A kernel variant was asked for that this CPU cannot run (or that does not exist)."""


def supported_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The variants a CPU with these flags (default: this one's) runs, fastest first. Without
    flags to read (not Linux), only the portable one; on other architectures likewise."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["portable"]
    return [isa for isa, needed in KERNEL_ISAS.items() if needed <= flags]


def resolve_isa(requested: str | None = None, flags: frozenset[str] | None = None) -> str:
    """``requested``, else ``PDSERVE_NATIVE_ISA``, else the fastest supported variant; raises
    ``UnsupportedIsaError`` naming the missing flags when the CPU cannot run the one asked for."""
    # Named in the errors: a node that refuses to start must say which setting to change.
    source = "isa argument" if requested else ISA_ENV
    requested = requested or os.environ.get(ISA_ENV) or None
    supported = supported_isas(flags)
    if requested is None:
        return supported[0]
    if requested not in KERNEL_ISAS:
        raise UnsupportedIsaError(
            f"{source}: unknown native kernel variant {requested!r}: choose one of "
            f"{', '.join(KERNEL_ISAS)}"
        )
    if requested not in supported:
        missing = sorted(KERNEL_ISAS[requested] - (cpu_flags() if flags is None else flags))
        raise UnsupportedIsaError(
            f"{source}: this CPU cannot run the {requested} native kernel (missing "
            f"{', '.join(missing) or 'an x86-64 CPU'}); it runs {', '.join(supported)}"
        )
    return requested


def native_kernel_error() -> str | None:
    """Builds and loads the kernel once per process; None if it is usable, else a one-line reason.

    Never raises: a missing compiler or a failed build is a reason, not an exception.
    """
    return _BUILD.error()


def _build_and_load() -> str | None:
    start = time.perf_counter()
    name = _EXTENSION_BASE_NAME
    try:
        # Named after the sources (headers included: torch's rebuild check reads only the
        # sources). A source missing from an installed package is a reason, like a failed build.
        digest = hashlib.sha256(b"".join(path.read_bytes() for path in _SOURCES + _HEADERS))
        name = f"{_EXTENSION_BASE_NAME}_{digest.hexdigest()[:12]}"
        # A plain library: the .so registers torch.ops.pdserve.* (TORCH_LIBRARY), no pybind11,
        # which keeps the compile short. No -march: each variant sets its own target; the op
        # runs on any x86-64 / Arm.
        load_extension(name, _SOURCES, cflags=["-O3", "-fopenmp"], ldflags=["-fopenmp"])
    except Exception as exc:  # compiler missing, build error, load error: all mean "fall back"
        logger.debug("building %s failed", name, exc_info=True)
        return build_error_summary(exc)
    elapsed = time.perf_counter() - start
    logger.info("native CPU kernels built or loaded in %.1f s", elapsed)
    return None


_BUILD = BuildOnce(_build_and_load)
