"""Host memory that other processes of this host can map: anonymous memfd files.

Life cycle of an allocation: `allocate()` creates a memfd (no name in any file system), sizes it
and maps it; the returned numpy array keeps the mapping alive, and the file descriptor is closed
when the last array over it is garbage collected. The kernel frees the memory when the last fd
and the last mapping are gone, so nothing outlives the processes that use it: no /dev/shm file
is ever created, and a SIGKILLed owner leaves nothing behind (its fd and mappings die with it;
a peer that mapped the memory drops its mapping when it sees the owner gone).

A peer maps an allocation by opening ``/proc/<owner pid>/fd/<fd>``, which needs the same PID
namespace and ptrace-read permission on the owner (same user, as for UCX's CMA lane). The
inode number published with the fd guards against a reused pid or fd number.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import threading
import weakref
from dataclasses import dataclass
from functools import cache

import numpy as np

# Name shown in /proc/<pid>/fd links ("/memfd:pdserve-kv (deleted)"); tests look for it.
MEMFD_NAME = "pdserve-kv"


@dataclass(frozen=True)
class SharedHandle:
    """How a peer process of this host maps an allocation."""

    pid: int
    fd: int
    inode: int
    length: int

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "fd": self.fd, "inode": self.inode, "length": self.length}

    @classmethod
    def from_json(cls, doc: dict[str, int]) -> SharedHandle:
        return cls(int(doc["pid"]), int(doc["fd"]), int(doc["inode"]), int(doc["length"]))


@dataclass(frozen=True)
class _Allocation:
    start: int
    length: int
    handle: SharedHandle


_lock = threading.Lock()
# Start address → live allocation of this process.
_allocations: dict[int, _Allocation] = {}


def allocate(num_bytes: int, name: str = MEMFD_NAME) -> np.ndarray:
    """A zeroed, writable uint8 array of `num_bytes` in shared memory."""
    if num_bytes <= 0:
        raise ValueError(f"a shared allocation needs at least one byte, not {num_bytes}")
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, num_bytes)
        mapping = mmap.mmap(fd, num_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    # Before the first touch: 2 MiB pages where the host allows them for shared memory
    # (/sys/kernel/mm/transparent_hugepage/shmem_enabled "advise" or "always"); the KV cache is
    # read in small blocks scattered over it, where 4 KiB pages cost a TLB miss per block.
    with contextlib.suppress(OSError, AttributeError):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    array = np.frombuffer(mapping, dtype=np.uint8)
    start = array.__array_interface__["data"][0]
    handle = SharedHandle(os.getpid(), fd, os.fstat(fd).st_ino, num_bytes)
    with _lock:
        _allocations[start] = _Allocation(start, num_bytes, handle)
    weakref.finalize(mapping, _release, start, fd)
    return array


def _release(start: int, fd: int) -> None:
    with _lock:
        _allocations.pop(start, None)
    with contextlib.suppress(OSError):
        os.close(fd)


def find_allocation(address: int, length: int) -> tuple[SharedHandle, int] | None:
    """(handle, offset) of the live allocation holding ``[address, address + length)``."""
    with _lock:
        for alloc in _allocations.values():
            if alloc.start <= address and address + length <= alloc.start + alloc.length:
                return alloc.handle, address - alloc.start
    return None


def map_peer(handle: SharedHandle) -> mmap.mmap:
    """Maps a peer's allocation into this process (or this process's own, through /proc).
    Raises ConnectionError saying why when it cannot."""
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConnectionError(
            f"shared memory of process {handle.pid} is gone (the process exited, or it runs in "
            "another PID namespace or on another host)"
        ) from None
    except PermissionError:
        raise ConnectionError(
            f"no permission to map shared memory of process {handle.pid} ({path}): the shm "
            "transport needs both nodes to run as the same user in one PID namespace"
        ) from None
    try:
        info = os.fstat(fd)
        if info.st_ino != handle.inode or info.st_size < handle.length:
            raise ConnectionError(
                f"{path} is not the shared memory the peer published (its process was replaced)"
            )
        return mmap.mmap(fd, handle.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def is_alive(pid: int) -> bool:
    """True while process `pid` exists (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # Field 3, after the parenthesised command name: the state letter.
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


class ProcessWatch:
    """Whether one process still runs, for checks made on every transfer: a pidfd (Linux 5.3+)
    turns readable once the process has ended, reaped or a zombie, and names that process only
    (a reused PID is not mistaken for it); a check is one ``poll`` (a few µs) where ``is_alive``
    opens and reads ``/proc/PID/stat`` (~20 µs). Without pidfds it falls back to ``is_alive``.
    Safe from any thread (a poll object per check: one shared by threads refuses concurrent
    use). The descriptor is closed when the watch is garbage-collected."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._gone = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):  # no pidfd_open here: read /proc each time
            pass
        else:
            weakref.finalize(self, os.close, self._fd)

    def is_alive(self) -> bool:
        if self._gone:
            return False
        if self._fd is None:
            return is_alive(self.pid)
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if poller.poll(0):
            self._gone = True
        return not self._gone


@cache
def host_identity() -> str:
    """Which host and PID namespace this process runs in: two processes with the same identity
    can map each other's shared memory (boot id + PID-namespace inode)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{boot}/{namespace}"
