"""benchmarks/embedding_throughput.py runs end to end on the tiny model: both runs reported, and
the two compute the same vectors (how fast is never asserted: a test does not bound time)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reports_both_runs_and_their_agreement(tiny_llama_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/embedding_throughput.py"), "--model",
         str(tiny_llama_dir), "--num-prompts", "6", "--min-len", "3", "--max-len", "20",
         "--dtype", "float32", "--batch-size", "4", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = re.findall(
        r"^(\S+)\s+[\d.]+ s\s+([\d.]+) prompt tok/s\s+([\d.]+)x$", result.stdout, re.M
    )
    assert [name for name, _, _ in rows] == ["pdserve", "transformers"], result.stdout
    assert rows[1][2] == "1.00" and all(float(rate) > 0 for _, rate, _ in rows)
    cosine = re.search(r"lowest cosine similarity between the two: ([\d.]+)", result.stdout)
    assert cosine is not None and float(cosine[1]) > 0.9999, result.stdout
