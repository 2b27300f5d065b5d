"""benchmarks/engine_host_overhead.py runs end to end on the tiny model and reports both times
(how long they are is never asserted: a test does not bound wall-clock time)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reports_the_step_and_the_staging_time(tiny_llama_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/engine_host_overhead.py"), "--model",
         str(tiny_llama_dir), "--batch", "8", "--steps", "20"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    match = re.search(
        r"batch 8: engine.step\(\) host time (\d+) us .* staging (\d+) us", result.stdout
    )
    assert match and int(match.group(1)) > 0 and int(match.group(2)) > 0, result.stdout
