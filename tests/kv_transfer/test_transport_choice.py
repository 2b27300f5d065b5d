"""`--kv-transport auto`: the rule, and the huge-page check read from the kernel's settings (a
fake sysfs tree per test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_transfer.memory import MemoryKind
from kv_transfer.transport_choice import choose_transport, shared_memory_huge_page_loss


def fake_thp(tmp_path: Path, enabled: str, shmem: str | None, pmd_shmem: str | None = None) -> Path:
    """A transparent_hugepage directory: `enabled`, `shmem_enabled` and, if given, the 2 MiB
    size's own `shmem_enabled` (kernels 6.11+), each with its choice in brackets."""
    values = {
        "enabled": ("always", "madvise", "never"),
        "shmem": ("always", "within_size", "advise", "never", "deny", "force"),
        "pmd": ("always", "inherit", "within_size", "advise", "never"),
    }

    def setting(kind: str, chosen: str) -> str:
        return " ".join(f"[{v}]" if v == chosen else v for v in values[kind]) + "\n"

    (tmp_path / "enabled").write_text(setting("enabled", enabled))
    if shmem is not None:
        (tmp_path / "shmem_enabled").write_text(setting("shmem", shmem))
    if pmd_shmem is not None:
        (tmp_path / "hpage_pmd_size").write_text("2097152\n")
        (tmp_path / "hugepages-2048kB").mkdir()
        (tmp_path / "hugepages-2048kB" / "shmem_enabled").write_text(setting("pmd", pmd_shmem))
    return tmp_path


@pytest.mark.parametrize(
    ("enabled", "shmem", "pmd_shmem", "loses"),
    [
        ("madvise", "never", None, True),  # this CI host's settings
        ("madvise", "never", "inherit", True),
        ("always", "deny", None, True),
        ("madvise", "advise", None, False),
        ("madvise", "within_size", None, False),
        ("always", "always", "inherit", False),
        ("madvise", "never", "advise", False),  # the 2 MiB size's own setting decides
        ("madvise", "advise", "never", True),
        ("never", "never", None, False),  # private memory gets none either
        ("madvise", None, None, True),  # a kernel with no huge pages for shared memory at all
    ],
)
def test_huge_page_loss_follows_the_kernel_settings(
    tmp_path: Path, enabled: str, shmem: str | None, pmd_shmem: str | None, loses: bool
) -> None:
    loss = shared_memory_huge_page_loss(fake_thp(tmp_path, enabled, shmem, pmd_shmem))
    assert (loss is not None) is loses
    if loses:
        assert "shmem_enabled" in loss and "no transparent huge pages" in loss


def test_no_transparent_huge_pages_in_the_kernel_is_no_loss(tmp_path: Path) -> None:
    assert shared_memory_huge_page_loss(tmp_path / "absent") is None


def test_auto_picks_shm_where_shared_memory_keeps_huge_pages(tmp_path: Path) -> None:
    root = fake_thp(tmp_path, "madvise", "advise")
    name, why = choose_transport("auto", MemoryKind.HOST, "host", root)
    assert (name, why) == ("shm", "auto: KV cache in host memory and every peer on this host")


def test_auto_keeps_shm_where_shared_memory_would_lose_them_and_says_so(
    tmp_path: Path,
) -> None:
    root = fake_thp(tmp_path, "madvise", "never")
    name, why = choose_transport("auto", MemoryKind.HOST, "host", root)
    assert name == "shm"
    assert f"{root / 'shmem_enabled'}: never" in why and "--kv-transport ucx" in why


def test_the_huge_page_check_never_overrides_other_choices(tmp_path: Path) -> None:
    root = fake_thp(tmp_path, "madvise", "never")
    assert choose_transport("ucx", MemoryKind.HOST, "host", root)[0] == "ucx"
    assert choose_transport("auto", MemoryKind.CUDA, "host", root)[0] == "cuda_ipc"
    assert choose_transport("auto", MemoryKind.HOST, "cluster", root)[0] == "ucx"
    with pytest.raises(ValueError, match="kv scope must be one of"):
        choose_transport("auto", MemoryKind.HOST, "planet", root)
