"""The supervisor with small stand-in children: prefixed output, stop order, SIGKILL after the
grace for a child that ignores SIGTERM, and grandchildren gone with their process group."""

from __future__ import annotations

import io
import re
import sys
import time
from pathlib import Path

from deploy.commands import ProcessSpec
from deploy.supervisor import Output, Supervisor


def child(name: str, code: str) -> ProcessSpec:
    return ProcessSpec(name, (sys.executable, "-c", code), (("GREETING", "hi"),), ())


SERVE = """
import os, signal, sys, time
def stop(*_):
    print("stopping", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print(os.environ["GREETING"], "from", os.getpid(), flush=True)
while True:
    time.sleep(0.05)
"""

STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("grandchild", grandchild.pid, flush=True)
while True:
    time.sleep(0.05)
"""


def is_gone(pid: int) -> bool:
    """No such process, or a zombie (ended; its new parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_for(predicate, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_children_are_prefixed_and_stopped_in_order() -> None:
    out = io.StringIO()
    supervisor = Supervisor(Output(out), grace_s=5)
    supervisor.start([child("node", SERVE), child("gateway", SERVE)])
    wait_for(lambda: out.getvalue().count("hi from") == 2)
    codes = supervisor.stop(first=("gateway",))
    assert codes == {"node": 0, "gateway": 0}
    lines = out.getvalue().splitlines()
    assert any(re.match(r"^\[node\] +hi from \d+$", line) for line in lines)
    stops = [line.split()[0] for line in lines if line.endswith("stopping")]
    assert stops == ["[gateway]", "[node]"]  # the gateway stops before the nodes it routes to


def test_a_child_ignoring_sigterm_is_killed_with_its_grandchildren() -> None:
    out = io.StringIO()
    supervisor = Supervisor(Output(out), grace_s=0.5)
    supervisor.start([child("stubborn", STUBBORN)])
    wait_for(lambda: "grandchild" in out.getvalue())
    grandchild = int(out.getvalue().split("grandchild")[1].split()[0])
    started = time.monotonic()
    codes = supervisor.stop()
    assert codes == {"stubborn": -9}
    assert time.monotonic() - started < 5
    assert "stubborn did not stop: SIGKILL" in out.getvalue()
    wait_for(lambda: is_gone(grandchild))  # killed with the child's process group


def test_exited_children_are_reported() -> None:
    out = io.StringIO()
    supervisor = Supervisor(Output(out), grace_s=1)
    supervisor.start([child("short", "print('bye')"), child("long", SERVE)])
    wait_for(lambda: [c.spec.name for c in supervisor.exited()] == ["short"])
    wait_for(lambda: "hi from" in out.getvalue())  # its SIGTERM handler is in place
    assert supervisor.stop() == {"short": 0, "long": 0}
    assert all(is_gone(c.pid) for c in supervisor.children)
