"""benchmarks/lora_overhead.py runs end to end on the tiny model and reports its four runs
(how fast they are is never asserted: a test does not bound wall-clock time)."""

from __future__ import annotations

import re
from pathlib import Path

from support.benchmark_script import run_benchmark


def test_reports_every_run_against_the_one_without_lora(tiny_llama_dir: Path) -> None:
    stdout = run_benchmark(
        "lora_overhead.py", "--model", tiny_llama_dir, "--num-prompts", "4", "--input-len",
        "8", "--output-len", "2", "--rank", "4", "--dtype", "float32", "--rounds", "1",
    )  # fmt: skip
    rows = re.findall(r"^(.+?)\s+[\d.]+ s\s+([\d.]+) output tok/s\s+([\d.]+)x$", stdout, re.M)
    assert [name.strip() for name, _, _ in rows] == [
        "no LoRA",
        "LoRA on, base requests",
        "one adapter",
        "two adapters, half each",
    ], stdout
    assert rows[0][2] == "1.00" and all(float(rate) > 0 for _, rate, _ in rows)
