"""What this CPU can run, read from ``/proc/cpuinfo``: its instruction-set flags (which native
kernel variants it runs) and a short hash of its identity that names per-CPU caches (the
measured compute dtype). The hash once named the native kernel's ``-march=native`` build; that
build now serves every host.

Torch-free: only the standard library, so any process may ask.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

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


@functools.cache
def cpu_tag() -> str:
    """A short hash of this CPU's model and instruction-set flags.

    Caches that depend on the CPU are named after it, so that a cache shared with (or copied
    from) another machine is never read as this one's: a measured GEMM rate belongs to one CPU.
    """
    identity = platform.machine()
    try:
        with _CPUINFO.open() as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags"))]
        identity += "".join(sorted(set(lines)))
    except OSError:
        identity += platform.processor()
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def cpu_cache_dir() -> Path:
    """Where per-CPU caches live: beside the native kernel's build, in torch's extension root
    (``TORCH_EXTENSIONS_DIR`` when set, else ``~/.cache/torch_extensions/py<ver>_cpu``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(cache_home) / "torch_extensions" / f"{version}_cpu"
