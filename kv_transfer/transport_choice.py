"""`--kv-transport auto`: which transport a node uses, and why (logged at start-up).

Same-host peers share memory directly: cuda_ipc for KV caches in device memory, shm for KV
caches in host memory. Peers on other hosts need a network: ucx. Both ends of a handoff apply
the same rule, so a prefill and a decode node of one deployment agree (the huge-page check below
reads the host kernel's settings, the same for every process of the host, containers included).

A trade-off the log states: with shm the KV cache lives in memfd shared memory, which gets
transparent huge pages only where the kernel's `shmem_enabled` allows, while the private cache
the engine allocates otherwise gets them through `madvise`. Where shared memory would lose them,
a decode step's attention over a cache of 4 KiB pages took 1.13-1.19x as long as over the
private one (`benchmarks/kv_cache_memory.py`), but a serving burst did not show it (ucx may cost
the decode node too: docs/benchmarks.md). So auto keeps shm and says so at start-up, naming
the setting and `--kv-transport ucx`.
"""

from __future__ import annotations

from pathlib import Path

from kv_transfer.memory import MemoryKind

# Where a node's KV peers run: "host" (this machine only: the launcher, compose) or "cluster"
# (possibly other machines).
KV_SCOPES = ("host", "cluster")

THP_ROOT = Path("/sys/kernel/mm/transparent_hugepage")
# shmem_enabled values under which memory that asks with MADV_HUGEPAGE gets huge pages.
_SHMEM_HUGE = ("always", "within_size", "advise", "force")


def choose_transport(
    requested: str, memory: MemoryKind, scope: str, thp_root: Path | None = None
) -> tuple[str, str]:
    """(transport name, why) for a node whose KV cache is `memory` and whose peers run in
    `scope`. A name other than "auto" is kept as given. ``thp_root``: where the kernel's
    transparent huge page settings are read (default THP_ROOT; tests use a fake tree)."""
    if scope not in KV_SCOPES:
        raise ValueError(f"kv scope must be one of {KV_SCOPES}, got {scope!r}")
    where = "device memory" if memory is MemoryKind.CUDA else "host memory"
    if requested != "auto":
        return requested, f"--kv-transport {requested} was asked for (KV cache in {where})"
    if scope == "cluster":
        return "ucx", f"auto: peers may run on other hosts (kv scope cluster); KV cache in {where}"
    if memory is MemoryKind.CUDA:
        return "cuda_ipc", "auto: KV cache in device memory and every peer on this host"
    why = "auto: KV cache in host memory and every peer on this host"
    loss = shared_memory_huge_page_loss(thp_root or THP_ROOT)
    if loss is not None:
        why += (
            f"; note: {loss}, so decode attention over the shared cache was measured up to 1.19x "
            "slower (docs/benchmarks.md); --kv-transport ucx keeps the cache private"
        )
    return "shm", why


def shared_memory_huge_page_loss(root: Path = THP_ROOT) -> str | None:
    """Why a KV cache in shared memory would get 4 KiB pages where a private one gets 2 MiB
    pages (the setting that refuses them), or None if it would not: both get them, or neither
    (no transparent huge pages in this kernel, or none for private memory either)."""
    private = sysfs_choice(root / "enabled")
    if private not in ("always", "madvise"):
        return None
    path = root / "shmem_enabled"
    setting = sysfs_choice(path)
    # Kernels with per-size settings (6.11+): the PMD size's own one decides unless "inherit".
    pmd = _pmd_shmem_path(root)
    pmd_setting = sysfs_choice(pmd) if pmd is not None else None
    if pmd is not None and pmd_setting not in (None, "inherit"):
        path, setting = pmd, pmd_setting
    if setting in _SHMEM_HUGE:
        return None
    return (
        f"shared memory gets no transparent huge pages here ({path}: {setting or 'absent'}) "
        "while private memory does"
    )


def _pmd_shmem_path(root: Path) -> Path | None:
    try:
        kib = int((root / "hpage_pmd_size").read_text()) // 1024
    except (OSError, ValueError):
        return None
    return root / f"hugepages-{kib}kB" / "shmem_enabled"


def sysfs_choice(path: Path) -> str | None:
    """The bracketed choice of a sysfs setting ("always [madvise] never" → "madvise")."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None
