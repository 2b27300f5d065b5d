"""benchmarks/kv_transfer_overhead.py runs end to end on the shm transport: both layouts push
and report a time (no assertion on how long: a test never bounds wall-clock time)."""

from __future__ import annotations

import re

from support.benchmark_script import run_benchmark


def test_both_layouts_push_and_report() -> None:
    stdout = run_benchmark("kv_transfer_overhead.py", "--pages", "64", "--repeats", "3")
    rows = re.findall(r"^\s*(contiguous|scattered)\s+(\d+)\s+(\d+)$", stdout, re.M)
    assert [name for name, _, _ in rows] == ["contiguous", "scattered"], stdout
    assert all(int(done) >= int(returned) > 0 for _, returned, done in rows), rows
