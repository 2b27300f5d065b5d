"""benchmarks/kv_transfer_overhead.py runs end to end on the shm transport: both layouts push
and report a time (no assertion on how long: a test never bounds wall-clock time)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_layouts_push_and_report() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/kv_transfer_overhead.py"), "--pages", "64",
         "--repeats", "3"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\s*(contiguous|scattered)\s+(\d+)\s+(\d+)$", result.stdout, re.M)
    assert [name for name, _, _ in rows] == ["contiguous", "scattered"], result.stdout
    assert all(int(done) >= int(returned) > 0 for _, returned, done in rows), rows
