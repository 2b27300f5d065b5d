"""The shm transport's compiled scatter-gather copy: one call copies a whole list of runs.

Why: KV pages scattered on both sides are each their own run (8 KiB for the `small` model). In
Python even the vectorised numpy path costs two calls per 32 pages through a bounce buffer and
reached 22 % of this host's memcpy bandwidth for a 24 MiB push; the loop in
``csrc/copy_runs.cpp`` checks every run against its regions, merges runs that follow on, and
writes each page with streaming stores (the decode process reads it next, not this core), all
in one call that releases the GIL (``docs/benchmarks.md``, issue 15).

Built the way the native attention kernel is (``services/models/native_build.py``):
``build_support.load_extension`` on first use, cached under ``build_support.extensions_root()``,
with ``-march=native`` and the build named after a hash of this CPU's model
and flags, so a cache shared with another machine never loads instructions this one lacks. The
source is plain C++ with a C ABI (no torch headers: the build takes a few seconds) and is called
through ctypes. ``native_copy_error`` says why the copy is unavailable instead of raising, and
the shm transport then keeps its numpy path.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kv_transfer.build_support import BuildOnce, build_error_summary, cpu_tag, load_extension

logger = logging.getLogger(__name__)

_EXTENSION_BASE_NAME = "pdserve_kv_copy_runs"
_SOURCE = Path(__file__).resolve().parent / "csrc" / "copy_runs.cpp"
_RUN_COLUMNS = 5  # (src region, src offset, dst region, dst offset, length)

_copy_runs: Callable[..., int] | None = None


def native_copy_error() -> str | None:
    """Builds and loads the copy once per process; None if it is usable, else a one-line reason.

    Never raises: a missing compiler or torch, or a failed build, is a reason, not an exception.
    """
    return _BUILD.error()


def copy_runs_native(
    runs: np.ndarray,
    src_bases: np.ndarray,
    src_lengths: np.ndarray,
    dst_bases: np.ndarray,
    dst_lengths: np.ndarray,
) -> None:
    """Copies every run and returns once every byte is visible to other processes.

    runs: int64 [num_runs, 5] as in ``TransferPlan.runs``; bases and lengths: int64
    [num_regions] of each side's regions (address in this process, bytes). Raises ValueError,
    before any byte moves, if a run is empty, lies outside its regions or names a region not
    given; RuntimeError if the copy is unavailable (see ``native_copy_error``).
    """
    error = native_copy_error()
    if error is not None or _copy_runs is None:
        raise RuntimeError(f"the native KV copy is unavailable: {error}")
    runs = np.ascontiguousarray(runs, dtype=np.int64)
    if runs.ndim != 2 or runs.shape[1] != _RUN_COLUMNS:
        raise ValueError(f"runs must be int64 [num_runs, {_RUN_COLUMNS}], got {runs.shape}")
    src_bases, src_lengths = _region_arrays(src_bases, src_lengths, "source")
    dst_bases, dst_lengths = _region_arrays(dst_bases, dst_lengths, "destination")
    bad = _copy_runs(
        runs.ctypes.data,
        len(runs),
        src_bases.ctypes.data,
        src_lengths.ctypes.data,
        len(src_bases),
        dst_bases.ctypes.data,
        dst_lengths.ctypes.data,
        len(dst_bases),
    )
    if bad >= 0:
        src, src_off, dst, dst_off, length = runs[bad].tolist()
        raise ValueError(
            f"run {bad}: {length} bytes from source region {src} at {src_off} to destination "
            f"region {dst} at {dst_off} is empty or outside its regions "
            f"({len(src_bases)} source, {len(dst_bases)} destination); nothing was copied"
        )


def _region_arrays(
    bases: np.ndarray, lengths: np.ndarray, side: str
) -> tuple[np.ndarray, np.ndarray]:
    bases = np.ascontiguousarray(bases, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if bases.ndim != 1 or bases.shape != lengths.shape:
        raise ValueError(
            f"{side} bases and lengths must be int64 [num_regions], got {bases.shape} and "
            f"{lengths.shape}"
        )
    if (lengths < 0).any():
        raise ValueError(f"{side} region lengths must not be negative: {lengths.tolist()}")
    return bases, lengths


def _build_and_load() -> str | None:
    global _copy_runs
    start = time.perf_counter()
    name = f"{_EXTENSION_BASE_NAME}_{cpu_tag()}"
    try:
        path = load_extension(name, [_SOURCE], cflags=["-O3", "-march=native"])
        function = ctypes.CDLL(path).pdserve_copy_runs
    except Exception as exc:  # no torch, no compiler, build or load error: all mean "fall back"
        logger.debug("building %s failed", name, exc_info=True)
        return build_error_summary(exc)
    function.restype = ctypes.c_int64
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
    ]
    _copy_runs = function
    logger.info("native KV copy built or loaded in %.1f s", time.perf_counter() - start)
    return None


_BUILD = BuildOnce(_build_and_load)
