"""The helpers the native builds share: the per-CPU tag, the one-line build error, the
once-per-process build and a build lock that a killed builder does not leave behind."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kv_transfer.build_support import BuildOnce, build_error_summary, build_name, cpu_tag

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_tag_is_a_short_stable_hash() -> None:
    assert re.fullmatch(r"[0-9a-f]{12}", cpu_tag())
    assert cpu_tag() == cpu_tag()


def test_checkouts_at_two_paths_build_in_directories_of_their_own(tmp_path: Path) -> None:
    """torch rebuilds a library whose sources moved; two checkouts sharing one directory rebuilt
    each other's on every alternation. The same sources at one path keep their directory."""
    here, there = tmp_path / "a" / "ops.cpp", tmp_path / "b" / "ops.cpp"
    toolchain = "torch 2.13.0"
    name = build_name("pdserve_ops", [here], toolchain)
    assert re.fullmatch(r"pdserve_ops_[0-9a-f]{8}", name)
    assert name == build_name("pdserve_ops", [tmp_path / "a" / "." / "ops.cpp"], toolchain)
    assert name != build_name("pdserve_ops", [there], toolchain)
    assert name != build_name("pdserve_ops", [here], "torch 2.14.0"), "another torch: rebuilt"


def test_a_build_log_becomes_its_head_and_first_cause() -> None:
    log = (
        "Error building extension 'pdserve_kv_copy_runs': [1/2] c++ -c copy.cpp\n"
        "FAILED: copy.o\n"
        "copy.cpp:3:10: fatal error: missing.h: No such file or directory\n"
        "compilation terminated.\n"
        "error: second cause\n"
    )
    summary = build_error_summary(RuntimeError(log))
    assert summary == (
        "RuntimeError: Error building extension 'pdserve_kv_copy_runs' | "
        "copy.cpp:3:10: fatal error: missing.h: No such file or directory"
    )
    assert "\n" not in summary


def test_long_parts_are_cut_and_an_empty_message_is_named() -> None:
    # "OSError: " is 9 characters, so a 20-character part keeps 11 of the message.
    assert build_error_summary(OSError("x" * 500), max_part=20) == "OSError: " + "x" * 11 + "..."
    assert build_error_summary(ValueError()) == "ValueError: no message"


def test_a_build_runs_once_for_threads_asking_together() -> None:
    calls: list[int] = []
    started = threading.Event()

    def build() -> str | None:
        calls.append(1)
        started.wait(1)  # hold the build while the other threads ask
        return "no compiler"

    once = BuildOnce(build)
    errors: list[str | None] = []
    threads = [threading.Thread(target=lambda: errors.append(once.error())) for _ in range(4)]
    for thread in threads:
        thread.start()
    started.set()
    for thread in threads:
        thread.join(5)

    assert calls == [1]
    assert errors == ["no compiler"] * 4
    assert once.error() == "no compiler" and calls == [1]


def _build_copy(env: dict[str, str]) -> subprocess.Popen[str]:
    """A process that builds (or loads) the native KV copy and prints why it is unusable."""
    script = "from kv_transfer.native_copy import native_copy_error; print(native_copy_error())"
    return subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_a_build_killed_midway_leaves_nothing_that_hangs_the_next(tmp_path: Path) -> None:
    """torch's own build lock is a file that waits for ever once its holder is killed; the next
    start (a node restarted after Ctrl-C during its first build) must build instead."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first = _build_copy(env)
    deadline = time.monotonic() + 120
    while first.poll() is None and time.monotonic() < deadline:
        locks = list(tmp_path.glob(f"pdserve_kv_copy_runs_{cpu_tag()}_*/lock"))
        if locks:
            (torch_lock,) = locks
            break
        time.sleep(0.005)
    else:
        pytest.fail("the first process never reached torch's build")
    assert torch_lock.exists(), "the first process never reached torch's build"
    first.kill()
    first.wait()
    assert torch_lock.exists()  # what a killed build leaves

    second = _build_copy(env)
    out, _ = second.communicate(timeout=240)
    assert (second.returncode, out.strip()) == (0, "None")
    assert not torch_lock.exists()

    torch_lock.touch()  # however it got there: the next load is not held up by it either
    third = _build_copy(env)
    out, _ = third.communicate(timeout=240)
    assert (third.returncode, out.strip()) == (0, "None")
