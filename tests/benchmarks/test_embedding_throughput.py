"""benchmarks/embedding_throughput.py runs end to end on the tiny model: both runs reported, and
the two compute the same vectors (how fast is never asserted: a test does not bound time)."""

from __future__ import annotations

import re
from pathlib import Path

from support.benchmark_script import run_benchmark


def test_reports_both_runs_and_their_agreement(tiny_llama_dir: Path) -> None:
    stdout = run_benchmark(
        "embedding_throughput.py", "--model", tiny_llama_dir, "--num-prompts", "6",
        "--min-len", "3", "--max-len", "20", "--dtype", "float32", "--batch-size", "4",
        "--rounds", "1",
    )  # fmt: skip
    rows = re.findall(r"^(\S+)\s+[\d.]+ s\s+([\d.]+) prompt tok/s\s+([\d.]+)x$", stdout, re.M)
    assert [name for name, _, _ in rows] == ["pdserve", "transformers"], stdout
    assert rows[1][2] == "1.00" and all(float(rate) > 0 for _, rate, _ in rows)
    cosine = re.search(r"lowest cosine similarity between the two: ([\d.]+)", stdout)
    assert cosine is not None and float(cosine[1]) > 0.9999, stdout
