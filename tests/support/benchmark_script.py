"""Runs one of ``benchmarks/`` end to end as a user would, for the tests that check what it
reports (never how fast: a test does not bound wall-clock time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str | Path, timeout_s: float = 300) -> str:
    """``python benchmarks/<script> args...``; its stdout, once it exited 0 (else the test
    fails with its stderr). ``timeout_s`` bounds a hang, not the benchmark's speed."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout
