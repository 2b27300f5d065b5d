"""What pdserve's native builds share: the tag that names a per-CPU build or cache, a one-line
summary of a failed build for the fallback's log line and error, and the once-per-process guard
around a build.

It lives in ``kv_transfer`` because that package imports nothing from the rest of pdserve: its
own native copy (``native_copy.py``) and the engine's CPU kernels and per-CPU caches
(``services/models/native_build.py``, ``services/engine/dtype_choice.py``) use this one copy.
Standard library only.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import threading
from collections.abc import Callable

_CPUINFO = "/proc/cpuinfo"


@functools.cache
def cpu_tag() -> str:
    """A short hash of this CPU's model and instruction-set flags.

    Builds and caches that depend on the CPU are named after it, so that one shared with (or
    copied from) another machine is never read as this one's: a measured GEMM rate belongs to one
    CPU.
    """
    identity = platform.machine()
    try:
        with open(_CPUINFO) as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags"))]
        identity += "".join(sorted(set(lines)))
    except OSError:
        identity += platform.processor()
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def build_error_summary(exc: BaseException, max_part: int = 200) -> str:
    """One line for a failed build or load: the exception's type and first line, and the first
    later line that names a cause, each cut at ``max_part`` characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # A failed build's message is "Error building extension 'name': <the whole ninja log>"; keep
    # its head and the log's first line that names the cause.
    head = lines[0].split(": [", 1)[0] if lines else "no message"
    parts = [f"{type(exc).__name__}: {head}"]
    causes = ("error:", "not found", "No such file")
    parts += [line for line in lines[1:] if any(cause in line for cause in causes)][:1]
    return " | ".join(part if len(part) <= max_part else part[:max_part] + "..." for part in parts)


class BuildOnce:
    """Runs ``build`` at most once per process, the first time ``error`` is asked, under a lock
    so that threads asking together wait for the one build. ``build`` returns None when the
    result is usable, else a one-line reason; it must not raise."""

    def __init__(self, build: Callable[[], str | None]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._done = False
        self._error: str | None = None

    def error(self) -> str | None:
        with self._lock:
            if not self._done:
                self._error = self._build()
                self._done = True
            return self._error
