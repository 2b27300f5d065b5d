"""Keeps glibc from handing freed activation buffers back to the kernel.

torch allocates CPU tensors with glibc ``malloc``. By default glibc serves large requests with
``mmap`` and trims the heap top on ``free``, so each step's multi-megabyte activations
(``[2048, 4096]`` bf16 is 16 MiB) come back as fresh pages that fault in and are zeroed one by
one. Measured on the ``small`` model: one prefill MLP of 2,048 tokens took 75 ms with the
defaults and 28 ms with the settings below. vLLM's CPU backend gets the same effect by
preloading tcmalloc; ``mallopt`` does it from inside the process, with no launcher.

Huge pages: the KV cache and the checkpoint's parameters are ``madvise``d where they are
allocated (``advise_huge_pages``). Everything else torch allocates (oneDNN's packed weights,
which decode streams at every step, and the activations) comes from glibc's heap, which glibc
puts on huge pages only when the process starts with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``:
a tunable is read once, at start-up. ``restart_with_huge_page_heap`` re-executes an entry point
(the nodes, the benchmarks) under it, before it has done anything else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
from collections.abc import Mapping

from kv_transfer.transport_choice import THP_ROOT, sysfs_choice

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit hosts; larger values are refused.
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 1 << 30

_configured = False


def keep_freed_memory_mapped() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where glibc is absent."""
    global _configured
    if _configured:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        logger.info("no glibc mallopt here: leaving the host allocator as it is")
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1 and ok
    _configured = ok
    return ok


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def advise_huge_pages(address: int, num_bytes: int) -> bool:
    """Ask the kernel to back ``[address, address + num_bytes)`` with 2 MiB pages.

    Call it before the memory is first written: pages already faulted in stay 4 KiB. The KV
    cache is read in block-sized pieces scattered over a gigabyte, where 4 KiB pages cost a TLB
    miss per block; on the ``small`` model a 64-sequence decode step went from ~110 ms to
    ~85 ms with huge pages. Only whole huge pages inside the range are advised.
    """
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + num_bytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True) if name else None
        madvise = libc.madvise if libc is not None else None
    except (OSError, AttributeError):
        return False
    if madvise is None:
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(start, end - start, _MADV_HUGEPAGE) == 0


HUGE_PAGE_HEAP_TUNABLE = "glibc.malloc.hugetlb"
"""glibc's tunable (2.35+): 1 makes malloc ``madvise(MADV_HUGEPAGE)`` its heap and mmap'd chunks."""


def huge_page_heap_env(
    env: Mapping[str, str], *, libc: tuple[str, str], thp_mode: str | None
) -> dict[str, str] | None:
    """``env`` with glibc's heap on huge pages; None where that changes nothing or is not ours
    to change.

    ``libc``: ``platform.libc_ver()``; ``thp_mode``: the bracketed word of the kernel's
    ``transparent_hugepage/enabled`` (None without THP). A ``glibc.malloc.hugetlb`` the caller
    already set, to any value, is theirs (``=0`` opts out); other tunables are kept.
    """
    name, version = libc
    if name != "glibc" or _version(version) < (2, 35):
        return None  # other C libraries, and older glibc, ignore the tunable
    if thp_mode not in ("always", "madvise"):
        return None
    tunables = env.get("GLIBC_TUNABLES", "")
    if any(t.split("=", 1)[0] == HUGE_PAGE_HEAP_TUNABLE for t in tunables.split(":")):
        return None
    setting = f"{HUGE_PAGE_HEAP_TUNABLE}=1"
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{setting}" if tunables else setting}


_TUNABLES_BEFORE_RESTART = "PDSERVE_GLIBC_TUNABLES_BEFORE_RESTART"
"""Set only across the re-execution: the caller's ``GLIBC_TUNABLES`` (``unset``, or ``=`` and its
value), which the restarted process puts back so that its own children start as they would have
(a compiler the native build runs, a process a node spawns) instead of inheriting the tunable."""

_startup_tunables: str | None = None
"""``GLIBC_TUNABLES`` as this process started, once ``restart_with_huge_page_heap`` has put the
caller's back; None where it has not run or changed nothing."""


def restart_with_huge_page_heap() -> None:
    """Re-execute this process with glibc's heap on huge pages, where it is not yet.

    Call it first thing in an entry point: the process starts over (same pid, same argv) and
    anything done before is lost. Returns where there is nothing to change, which is always the
    case after the restart; the restarted process then gives ``os.environ`` back the caller's
    ``GLIBC_TUNABLES`` (the tunable is read once, at start-up, so its heap stays on huge pages
    while its children do not inherit the setting). Measured on the ``small`` model (AMX host,
    bf16, three interleaved pairs, docs/benchmarks.md): prefill +9 %; the AMX decode linears
    stream 4 % faster.
    """
    global _startup_tunables
    if _startup_tunables is not None:
        return  # restarted already; the environment holds the caller's tunables again
    before = os.environ.pop(_TUNABLES_BEFORE_RESTART, None)
    if before is not None:
        _startup_tunables = os.environ.get("GLIBC_TUNABLES", "")
        if before.startswith("="):
            os.environ["GLIBC_TUNABLES"] = before[1:]
        else:
            os.environ.pop("GLIBC_TUNABLES", None)
        return
    env = huge_page_heap_env(os.environ, libc=platform.libc_ver(), thp_mode=thp_mode())
    if env is None:
        return
    original = os.environ.get("GLIBC_TUNABLES")
    env[_TUNABLES_BEFORE_RESTART] = "unset" if original is None else f"={original}"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return  # runs on as it is; the node's start-up log says the heap is not on huge pages


def heap_on_huge_pages() -> bool:
    """Whether glibc was told, at this process's start, to put its heap on huge pages."""
    started_with = (
        _startup_tunables if _startup_tunables is not None else os.environ.get("GLIBC_TUNABLES", "")
    )
    host_takes_it = huge_page_heap_env({}, libc=platform.libc_ver(), thp_mode=thp_mode())
    return f"{HUGE_PAGE_HEAP_TUNABLE}=1" in started_with.split(":") and host_takes_it is not None


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (always, madvise, never); None without THP."""
    return sysfs_choice(THP_ROOT / "enabled")


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)
