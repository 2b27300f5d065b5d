"""glibc's heap on huge pages: which environment asks for it, and a process restarted under it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.host_memory import HUGE_PAGE_HEAP_TUNABLE, huge_page_heap_env
from support.huge_page_heap import host_takes_huge_page_heap

ROOT = Path(__file__).resolve().parents[2]
GLIBC = ("glibc", "2.36")
ON = f"{HUGE_PAGE_HEAP_TUNABLE}=1"


def test_the_tunable_is_added_where_glibc_and_thp_take_it() -> None:
    env = huge_page_heap_env({"PATH": "/bin"}, libc=GLIBC, thp_mode="madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": ON}
    assert huge_page_heap_env({}, libc=GLIBC, thp_mode="always") == {"GLIBC_TUNABLES": ON}


def test_other_tunables_are_kept() -> None:
    env = huge_page_heap_env(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, libc=GLIBC, thp_mode="madvise"
    )
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{ON}"}


@pytest.mark.parametrize("value", ["0", "1", "2"])
def test_a_setting_of_the_user_is_left_alone(value: str) -> None:
    tunables = f"glibc.malloc.arena_max=2:{HUGE_PAGE_HEAP_TUNABLE}={value}"
    env = {"GLIBC_TUNABLES": tunables}
    assert huge_page_heap_env(env, libc=GLIBC, thp_mode="madvise") is None


@pytest.mark.parametrize(
    ("libc", "thp_mode"),
    [
        (("glibc", "2.34"), "madvise"),  # before the tunable: it would be ignored
        (("", ""), "madvise"),  # musl and others
        (GLIBC, "never"),
        (GLIBC, None),  # a kernel without THP
    ],
)
def test_nothing_changes_where_the_tunable_would_do_nothing(
    libc: tuple[str, str], thp_mode: str | None
) -> None:
    assert huge_page_heap_env({}, libc=libc, thp_mode=thp_mode) is None


def heap_flags_after_restart(env: dict[str, str]) -> dict[str, object]:
    """Run a child that restarts itself, allocates 64 MiB through malloc, and reports its
    GLIBC_TUNABLES, pid before and after the restart, and whether a heap mapping is huge-page
    advised (``hg`` in /proc/self/smaps)."""
    script = f"""
import json, os, sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
first_pid = os.environ.get("FIRST_PID") or str(os.getpid())
os.environ["FIRST_PID"] = first_pid
from services.host_memory import restart_with_huge_page_heap, heap_on_huge_pages
from support.huge_page_heap import heap_is_huge_page_advised
restart_with_huge_page_heap()
restart_with_huge_page_heap()  # a second call changes nothing
chunks = [bytearray(1 << 20) for _ in range(64)]  # under the mmap threshold: from the heap
import subprocess
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('GLIBC_TUNABLES'))"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps({{"tunables": os.environ.get("GLIBC_TUNABLES", ""),
                   "advised": heap_is_huge_page_advised(os.getpid()),
                   "same_pid": first_pid == str(os.getpid()), "reported": heap_on_huge_pages(),
                   "child_tunables": child}}))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not host_takes_huge_page_heap(), reason="needs glibc 2.35+ and THP")
def test_a_restarted_process_has_its_heap_on_huge_pages() -> None:
    # Its heap is on huge pages, while its environment, and so its children's, is the caller's
    # again (no GLIBC_TUNABLES here; other tunables of the caller's below).
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    report = heap_flags_after_restart(env)
    assert report == {
        "tunables": "", "advised": True, "same_pid": True, "reported": True,
        "child_tunables": "None",
    }  # fmt: skip


@pytest.mark.skipif(not host_takes_huge_page_heap(), reason="needs glibc 2.35+ and THP")
def test_the_callers_other_tunables_are_given_back_after_the_restart() -> None:
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    report = heap_flags_after_restart(env)
    assert report["advised"] is True and report["reported"] is True
    assert report["tunables"] == "glibc.malloc.arena_max=2"
    assert report["child_tunables"] == "glibc.malloc.arena_max=2"


@pytest.mark.skipif(not host_takes_huge_page_heap(), reason="needs glibc 2.35+ and THP")
def test_an_opt_out_keeps_the_heap_on_small_pages() -> None:
    env = {**os.environ, "GLIBC_TUNABLES": f"{HUGE_PAGE_HEAP_TUNABLE}=0"}
    report = heap_flags_after_restart(env)
    assert report["tunables"] == f"{HUGE_PAGE_HEAP_TUNABLE}=0"
    assert report["child_tunables"] == f"{HUGE_PAGE_HEAP_TUNABLE}=0"  # the user's, inherited
    assert report["advised"] is False
    assert report["reported"] is False
