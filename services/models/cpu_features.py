"""What this CPU can run, read from ``/proc/cpuinfo``: its instruction-set flags (which native
kernel variants it runs), and where per-CPU caches live. The short hash of the CPU's identity
that names those caches is ``kv_transfer.build_support.cpu_tag``, shared with the KV copy's build.

Torch-free: only the standard library, so any process may ask.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from kv_transfer.build_support import extensions_root

logger = logging.getLogger(__name__)

_CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty where there is none,
    e.g. macOS): what the kernel says user code may execute."""
    try:
        with _CPUINFO.open() as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_cache_dir() -> Path:
    """Where per-CPU caches live: beside the native kernel's build
    (``kv_transfer.build_support.extensions_root``)."""
    return extensions_root()
