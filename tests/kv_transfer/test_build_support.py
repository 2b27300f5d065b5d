"""The helpers the native builds share: the per-CPU tag and the one-line build error."""

from __future__ import annotations

import re
import threading

from kv_transfer.build_support import BuildOnce, build_error_summary, cpu_tag


def test_the_cpu_tag_is_a_short_stable_hash() -> None:
    assert re.fullmatch(r"[0-9a-f]{12}", cpu_tag())
    assert cpu_tag() == cpu_tag()


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
