"""The KV cache dtype benchmark's accuracy arithmetic: perplexity of the prompt tokens, logprob
differences against the reference, and top-1 agreement; and a run of its engine helpers on the
tiny model."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from kv_cache_dtype import accuracy, prompt_logprobs  # noqa: E402

from services.engine import LLM  # noqa: E402


def test_accuracy_counts_perplexity_differences_and_top1_agreement() -> None:
    # One prompt [7, 8, 9]: entries for positions 1 and 2 (position 0 has none).
    prompts = [[7, 8, 9]]
    reference = [[{8: -0.5, 3: -1.5}, {9: -1.0, 4: -0.2}]]  # top-1: 8, then 4
    other = [[{8: -0.7, 3: -0.1}, {9: -1.0, 4: -2.0}]]  # top-1: 3, then 9

    same = accuracy(reference, reference, prompts)
    assert same["mean_abs_logprob_diff"] == 0 and same["top1_agreement"] == 1
    assert same["perplexity"] == pytest.approx(math.exp((0.5 + 1.0) / 2))

    result = accuracy(reference, other, prompts)
    assert result["positions"] == 2
    assert result["mean_abs_logprob_diff"] == pytest.approx(0.1)
    assert result["max_abs_logprob_diff"] == pytest.approx(0.2)
    assert result["top1_agreement"] == 0
    assert result["perplexity"] == pytest.approx(math.exp((0.7 + 1.0) / 2))


def test_prompt_logprobs_hold_each_prompt_token_after_the_first(tiny_llama_dir: Path) -> None:
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=1 << 22, max_model_len=64)
    prompts = [[5, 17, 300, 41], [9, 9]]
    rows = prompt_logprobs(llm, prompts)
    assert [len(r) for r in rows] == [3, 1]
    for prompt, entries in zip(prompts, rows, strict=True):
        for token, entry in zip(prompt[1:], entries, strict=True):
            assert token in entry and entry[token] <= 0
