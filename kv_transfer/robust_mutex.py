"""A process-shared, robust POSIX mutex living in shared memory (glibc, through ctypes).

Robust: when the process holding it dies (SIGKILL included), the kernel hands it to the next
locker with EOWNERDEAD instead of leaving it locked forever. That is what lets the shm fence wait
for "no writer inside a copy" without trusting the writer to survive. ctypes releases the GIL
during each call, so a thread waiting for the lock does not stop the others.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import errno
import time

# sizeof(pthread_mutex_t) on 64-bit glibc is 40; slots reserve 64 for it.
MUTEX_BYTES = 64

_CLOCK_MONOTONIC = 1
_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for fn in (
        "pthread_mutexattr_init",
        "pthread_mutexattr_setpshared",
        "pthread_mutexattr_setrobust",
        "pthread_mutex_init",
        "pthread_mutex_lock",
        "pthread_mutex_clocklock",
        "pthread_mutex_unlock",
        "pthread_mutex_consistent",
    ):
        getattr(libc, fn).restype = ctypes.c_int
    return libc


_libc = _load()


class Locked(enum.Enum):
    OK = "ok"
    # The previous holder died while holding it: the protected state may be half updated.
    OWNER_DIED = "owner_died"
    TIMED_OUT = "timed_out"


def init_mutex(address: int) -> None:
    """Initialises a mutex at `address` (MUTEX_BYTES of zeroed shared memory), once, by the
    owner of the memory, before any peer can see it."""
    attr = ctypes.create_string_buffer(16)
    _check(_libc.pthread_mutexattr_init(attr), "pthread_mutexattr_init")
    _check(_libc.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED), "setpshared")
    _check(_libc.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST), "setrobust")
    _check(_libc.pthread_mutex_init(ctypes.c_void_p(address), attr), "pthread_mutex_init")


def lock(address: int, timeout: float | None) -> Locked:
    """Locks the mutex, waiting at most `timeout` seconds (None: forever). OWNER_DIED also
    holds the lock (made consistent again): the caller repairs what the dead holder left."""
    mutex = ctypes.c_void_p(address)
    if timeout is None:
        code = _libc.pthread_mutex_lock(mutex)
    else:
        at = time.clock_gettime(time.CLOCK_MONOTONIC) + max(0.0, timeout)
        spec = _Timespec(int(at), int((at % 1) * 1e9))
        code = _libc.pthread_mutex_clocklock(mutex, _CLOCK_MONOTONIC, ctypes.byref(spec))
    if code == 0:
        return Locked.OK
    if code == errno.ETIMEDOUT:
        return Locked.TIMED_OUT
    if code == errno.EOWNERDEAD:
        _check(_libc.pthread_mutex_consistent(mutex), "pthread_mutex_consistent")
        return Locked.OWNER_DIED
    raise OSError(code, f"pthread_mutex_lock: {errno.errorcode.get(code, code)}")


def unlock(address: int) -> None:
    _check(_libc.pthread_mutex_unlock(ctypes.c_void_p(address)), "pthread_mutex_unlock")


def _check(code: int, what: str) -> None:
    if code != 0:
        raise OSError(code, f"{what}: {errno.errorcode.get(code, code)}")
