"""The launcher's restart policy: back-off, budget, and a process that keeps dying left down
while the others keep running (real child processes, no model)."""

from __future__ import annotations

import io
import sys
import threading
import time

import pytest

from deploy.commands import ProcessSpec
from deploy.launch import Launcher
from deploy.restarts import RestartBook, RestartPolicy
from deploy.supervisor import Output
from deploy.topology import Topology


def test_backoff_doubles_up_to_its_cap_and_the_budget_is_per_window() -> None:
    book = RestartBook(RestartPolicy(budget=3, window_s=100, initial_backoff_s=1, max_backoff_s=3))
    assert book.died("d", 0) == 1
    assert book.died("d", 10) == 2
    assert book.died("d", 20) == 3  # capped
    assert book.died("d", 30) is None  # 3 restarts within 100 s: left down
    assert book.died("p", 30) == 1  # per process
    assert book.died("d", 200) == 1  # the window moved on: a fresh budget
    assert RestartBook(RestartPolicy(budget=0)).died("x", 0) is None


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        RestartPolicy(budget=-1)
    with pytest.raises(ValueError, match="max_backoff_s"):
        RestartPolicy(initial_backoff_s=5, max_backoff_s=1)


def test_a_process_that_keeps_dying_is_left_down_and_the_others_keep_running() -> None:
    flaky = ProcessSpec(
        name="flaky",
        argv=(sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"),
        env=(),
        health=(),
    )
    steady = ProcessSpec(
        name="steady", argv=(sys.executable, "-c", "import time; time.sleep(120)"), env=(),
        health=(),
    )  # fmt: skip
    out = io.StringIO()
    launcher = Launcher(
        Topology(),
        [flaky, steady],
        grace_s=5,
        startup_timeout_s=30,
        output=Output(out),
        restarts=RestartPolicy(budget=2, window_s=300, initial_backoff_s=0.05),
    )

    def stop_once_left_down() -> None:
        deadline = time.monotonic() + 60
        while "leaving it down" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        steady_child = next(c for c in launcher.supervisor.children if c.spec.name == "steady")
        alive.append(steady_child.is_alive)
        launcher.stop_requested.set()

    alive: list[bool] = []
    watcher = threading.Thread(target=stop_once_left_down)
    watcher.start()
    code = launcher.run()
    watcher.join()
    log = out.getvalue()
    assert code == 0, log
    assert log.count("restarted flaky") == 2
    assert "flaky exited with 3 and keeps dying (2 restarts within 300 s): leaving it down" in log
    assert "restarted steady" not in log and alive == [True]
