"""Runs child processes as one unit and leaves none behind.

Life cycle of a child:

1. ``start``    spawned in a session (and process group) of its own, so a terminal's Ctrl-C
                reaches only the launcher, which then stops the children in order; with
                ``PR_SET_PDEATHSIG`` = SIGTERM, so a launcher killed outright (SIGKILL, OOM)
                still takes its children with it (they drain as on any SIGTERM).
2. running      stdout and stderr merged into one pipe, each line copied to the launcher's
                output behind a ``[name]`` prefix by a thread per child.
3. ``restart``  a child that died is spawned again from its spec (the launcher decides when:
                ``deploy.restarts``); what the dead one's session left is SIGKILLed first.
4. ``stop``     SIGTERM (nodes drain: health NOT_SERVING, in-flight requests finish), wait up to
                ``grace_s``, then SIGKILL; last, SIGKILL to each child's whole process group,
                which catches grandchildren (a compiler the node started, say).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from deploy.commands import ProcessSpec

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_COLORS = (36, 33, 35, 32, 34, 31, 96, 93, 95, 92)


def _die_with(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn``: it runs in the child between fork and exec, and must not import."""

    def setup() -> None:
        if _libc is not None:
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        # The parent may have died before the prctl: then no signal would ever come.
        if os.getppid() != parent_pid:
            os._exit(1)

    return setup


@dataclass
class Child:
    spec: ProcessSpec
    process: subprocess.Popen[str]
    pump: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def is_alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class Output:
    """The launcher's output, shared by the pump threads; a line is never interleaved."""

    stream: TextIO
    width: int = 8
    lock: threading.Lock = field(default_factory=threading.Lock)
    is_closed: bool = False

    @property
    def colored(self) -> bool:
        return self.stream.isatty() and "NO_COLOR" not in os.environ

    def prefix(self, name: str, color: int) -> str:
        label = f"[{name}]".ljust(self.width + 2)
        return f"\033[{color}m{label}\033[0m " if self.colored else f"{label} "

    def write_line(self, prefix: str, line: str) -> None:
        with self.lock:
            if self.is_closed:
                return
            try:
                self.stream.write(prefix + line.rstrip("\n") + "\n")
                self.stream.flush()
            except (BrokenPipeError, ValueError):
                # The reader went away (``make run | head``). Keep draining the children's
                # pipes regardless: a child blocked on a full pipe would never drain on SIGTERM.
                self.is_closed = True


class Supervisor:
    def __init__(self, output: Output, *, grace_s: float) -> None:
        self.output = output
        self.grace_s = grace_s
        self.children: list[Child] = []
        self.force = threading.Event()
        """Set (a second Ctrl-C) to skip what is left of the grace: SIGKILL at once."""

    def start(self, specs: Sequence[ProcessSpec]) -> None:
        """Spawns every child before any pump thread exists: forking while other threads run
        is what ``preexec_fn`` warns about."""
        self.output.width = max([self.output.width, *(len(s.name) for s in specs)])
        for spec in specs:
            self.children.append(Child(spec, self._spawn(spec)))
        for i, child in enumerate(self.children):
            self._start_pump(child, i)

    def restart(self, name: str) -> Child:
        """Spawn the dead child ``name`` again; returns the new one. Forking now that pump
        threads run is safe enough here: the ``preexec_fn`` only calls ``prctl`` and
        ``getppid``, taking no lock another thread could hold."""
        index = next(i for i, c in enumerate(self.children) if c.spec.name == name)
        old = self.children[index]
        assert not old.is_alive, f"{name} is still running"
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(old.pid, signal.SIGKILL)  # the dead one's leftovers
        if old.pump is not None:
            old.pump.join(timeout=5)
        child = Child(old.spec, self._spawn(old.spec))
        self.children[index] = child
        self._start_pump(child, index)
        return child

    def _spawn(self, spec: ProcessSpec) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(spec.env)}
        return subprocess.Popen(
            spec.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=_die_with(os.getpid()),
        )

    def _start_pump(self, child: Child, index: int) -> None:
        prefix = self.output.prefix(child.spec.name, _COLORS[index % len(_COLORS)])
        child.pump = threading.Thread(
            target=self._pump, args=(child, prefix), name=f"pump-{child.spec.name}", daemon=True
        )
        child.pump.start()

    def _pump(self, child: Child, prefix: str) -> None:
        assert child.process.stdout is not None
        for line in child.process.stdout:
            self.output.write_line(prefix, line)

    def exited(self) -> list[Child]:
        return [child for child in self.children if not child.is_alive]

    def stop(self, first: Sequence[str] = ()) -> dict[str, int]:
        """Stops the children named in ``first``, then the others; returns each exit code
        (negative: the signal that ended it)."""
        early = [c for c in self.children if c.spec.name in first]
        late = [c for c in self.children if c.spec.name not in first]
        for wave in (early, late):
            self._stop_wave(wave)
        for child in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)  # the session's leftovers
        for child in self.children:
            if child.pump is not None:
                child.pump.join(timeout=5)
        return {child.spec.name: child.process.wait() for child in self.children}

    def _stop_wave(self, wave: Sequence[Child]) -> None:
        for child in wave:
            if child.is_alive:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while any(c.is_alive for c in wave) and time.monotonic() < deadline:
            if self.force.wait(0.1):
                break
        for child in wave:
            if child.is_alive:
                self.output.write_line("", f"[launch] {child.spec.name} did not stop: SIGKILL")
                child.process.kill()
            child.process.wait()
