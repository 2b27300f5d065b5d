"""Whether a process's heap is on huge pages, as the node entry points arrange
(``services/host_memory.restart_with_huge_page_heap``)."""

from __future__ import annotations

import platform
import re
from pathlib import Path

from services.host_memory import huge_page_heap_env, thp_mode


def host_takes_huge_page_heap() -> bool:
    """glibc 2.35+ and a kernel whose THP mode lets ``madvise`` ask for huge pages."""
    return huge_page_heap_env({}, libc=platform.libc_ver(), thp_mode=thp_mode()) is not None


def heap_is_huge_page_advised(pid: int) -> bool:
    """A ``[heap]`` mapping of ``pid`` carries ``hg`` (MADV_HUGEPAGE) in /proc/PID/smaps."""
    mapping = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            mapping = line
        elif line.startswith("VmFlags") and "[heap]" in mapping and "hg" in line.split():
            return True
    return False
