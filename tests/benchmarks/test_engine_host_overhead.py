"""benchmarks/engine_host_overhead.py runs end to end on the tiny model and reports both times
(how long they are is never asserted: a test does not bound wall-clock time)."""

from __future__ import annotations

import re
from pathlib import Path

from support.benchmark_script import run_benchmark


def test_reports_the_step_and_the_staging_time(tiny_llama_dir: Path) -> None:
    stdout = run_benchmark(
        "engine_host_overhead.py", "--model", tiny_llama_dir, "--batch", "8", "--steps", "20"
    )
    match = re.search(r"batch 8: engine.step\(\) host time (\d+) us .* staging (\d+) us", stdout)
    assert match and int(match.group(1)) > 0 and int(match.group(2)) > 0, stdout
