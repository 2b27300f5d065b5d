"""benchmarks/gguf_codes.py runs end to end on a tiny GGUF file: both linears tables' rows, the
two engines' weight bytes (codes fewer), and every output equal between them (how fast either
is is never asserted: a test does not bound wall-clock time)."""

from __future__ import annotations

import re

import pytest

from services.models.gguf_linear import gguf_codes_unavailable_reason
from support.benchmark_script import run_benchmark


def test_reports_linears_weight_bytes_and_equal_outputs(tiny_gguf_factory) -> None:
    import torch

    if gguf_codes_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("GGUF weights are dequantized here")
    path = tiny_gguf_factory("llama", "Q4_0")
    stdout = run_benchmark(
        "gguf_codes.py", "--model", path, "--layers", "1", "--rows", "1,3", "--trials", "1",
        "--batch-sizes", "1,3", "--output-len", "3",
    )  # fmt: skip
    assert "4-bit codes" in stdout, stdout
    linears = stdout.split("codes: weights")[0]
    assert re.findall(r"^\s*(\d+) \|", linears, re.M) == ["1", "3"], stdout
    (codes,) = re.findall(r"^codes: weights (\d+) MiB", stdout, re.M)
    (fp32,) = re.findall(r"^fp32: weights (\d+) MiB", stdout, re.M)
    assert int(codes) < int(fp32), stdout
    same = re.findall(r"\| (\d+)/(\d+)$", stdout, re.M)
    assert same == [("1", "1"), ("3", "3")], stdout
