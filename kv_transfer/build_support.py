"""What pdserve's native builds share: the tag that names a per-CPU build or cache, the root
directory of builds and caches, the build itself under a lock that dies with its holder, a
one-line summary of a failed build for the fallback's log line and error, and the
once-per-process guard around a build.

It lives in ``kv_transfer`` because that package imports nothing from the rest of pdserve: its
own native copy (``native_copy.py``) and the engine's CPU kernels and per-CPU caches
(``services/models/native_build.py``, ``services/engine/dtype_choice.py``) use this one copy.
Standard library only, but for ``load_extension``, which imports torch when called.

Life cycle of a build directory (``load_extension``): every process that loads an extension,
built or not, first takes ``<root>/<name>.flock`` (``flock``: the kernel drops it when the
holder dies, however it dies), then lets torch check, build if needed, and load. torch guards
the same step with a lock *file* of its own (``<root>/<name>/lock``, created and deleted by its
holder), and waits for it to vanish, for ever: a process killed inside that step (a node
stopped during start-up, Ctrl-C on a first ``make run``) left every later start hung. Under the
flock no live pdserve process can hold torch's file, so one found there is stale and removed.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

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


def extensions_root() -> Path:
    """Where native builds and per-CPU caches live: ``TORCH_EXTENSIONS_DIR`` when set, else
    ``~/.cache/torch_extensions/py<ver>_cpu`` (the builds are CPU code whatever torch's build)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(cache_home) / "torch_extensions" / f"{version}_cpu"


def load_extension(
    name: str, sources: Sequence[Path], *, cflags: Sequence[str], ldflags: Sequence[str] = ()
) -> str:
    """Compiles (if needed) and loads a plain shared library (no pybind11) into
    ``extensions_root() / name`` with ``torch.utils.cpp_extension.load``, under a lock that a
    killed holder cannot leave behind (module docstring); returns the library's path. Raises
    what ``load`` raises.

    The directory is ``name`` and a hash of where the sources and torch are
    (``build_name``)."""
    import torch
    from torch.utils.cpp_extension import load

    name = build_name(name, sources, f"{torch.__file__} {torch.__version__}")
    root = extensions_root()
    build_directory = root / name
    build_directory.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.flock", "a") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)  # released on close, or by the kernel at death
        stale = build_directory / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a process killed while it built", stale)
            stale.unlink(missing_ok=True)
        path = load(
            name=name,
            sources=[str(path) for path in sources],
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            build_directory=str(build_directory),
            is_python_module=False,
            verbose=False,
        )
    return str(path)


def build_name(name: str, sources: Sequence[Path], toolchain: str) -> str:
    """``name`` and a short hash of the sources' paths and of ``toolchain`` (the torch it links
    against). torch's rebuild check compares a build with the previous one in its directory,
    paths included, so two checkouts (or virtual environments) that shared one directory rebuilt
    each other's library each time the other one ran (100-200 s of compiling on a 2-core host);
    each now has its own, built once."""
    where = "\n".join([*(str(Path(path).resolve()) for path in sources), toolchain])
    return f"{name}_{hashlib.sha256(where.encode()).hexdigest()[:8]}"


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
