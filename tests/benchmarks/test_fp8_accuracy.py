"""The fp8 accuracy benchmark: its comparison arithmetic, and a run on the tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from fp8_accuracy import compare  # noqa: E402

from support.benchmark_script import run_benchmark  # noqa: E402


def test_compare_counts_agreement_logprob_changes_and_greedy_prefixes() -> None:
    # (the actual token's logprob, the top-1 id) per position; greedy answers per question.
    reference = {"positions": [(-0.5, 8), (-1.0, 4)], "answers": [[1, 2, 3], [5, 6]]}
    other = {"positions": [(-0.7, 3), (-1.0, 4)], "answers": [[1, 2, 9], [5, 6, 7]]}
    figures = compare(reference, other)
    assert figures["positions"] == 2
    assert figures["top1_agreement"] == 0.5
    assert figures["mean_abs_logprob_change"] == pytest.approx(0.1)
    assert figures["max_abs_logprob_change"] == pytest.approx(0.2)
    # The first difference at index 2; an answer that is a prefix of the other counts whole.
    assert figures["greedy_tokens_equal_before_first_difference"] == [2, 2]


def test_a_tiny_model_run_reports_both_variants(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    stdout = run_benchmark("fp8_accuracy.py", "--model", tiny_llama_dir, "--json", out)
    results = json.loads(out.read_text())
    assert set(results["vs_float32"]) == {"bfloat16", "fp8"}
    for name, figures in results["vs_float32"].items():
        assert f"{name:>8} vs float32" in stdout
        assert figures["positions"] > 100
        assert 0 <= figures["top1_agreement"] <= 1
        assert figures["mean_abs_logprob_change"] > 0  # neither is float32 itself
        assert len(figures["greedy_tokens_equal_before_first_difference"]) == 4
    assert set(results["answers"]) == {"float32", "bfloat16", "fp8"}
