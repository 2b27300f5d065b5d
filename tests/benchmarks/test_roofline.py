"""The roofline report's arithmetic: which weights count, the decode step's bound, and when a run
was too noisy to compare."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import roofline  # noqa: E402
from roofline import (  # noqa: E402
    NOISY_SPREAD,
    attention_flops,
    causal_pairs,
    decode_bound_s,
    gemm_peaks,
    gemm_spread,
    weight_counts,
)

from services.engine import LLM  # noqa: E402
from services.engine.dtype_choice import (  # noqa: E402
    GemmShape,
    time_gemm_pass,
    time_packed_pass,
)


def test_decode_bound_is_compute_or_memory_whichever_is_slower() -> None:
    # 100M weights in bf16, 64 sequences each reading 10 MB of K/V: 200 MB + 640 MB at 10 GB/s
    # is 84 ms; 12.8 GFLOP at 1 TFLOP/s is 12.8 ms.
    compute, memory = decode_bound_s(
        weights=100_000_000, itemsize=2, num_seqs=64, kv_bytes_per_seq=10e6,
        attention_flops_per_seq=0.0, peak_flops=1e12, bandwidth=10e9,
    )  # fmt: skip
    assert compute == pytest.approx(0.0128) and memory == pytest.approx(0.084)
    # Each sequence's attention products (10 MFLOP here) add to the compute: 64 x 10 MFLOP.
    compute, _ = decode_bound_s(
        weights=100_000_000, itemsize=2, num_seqs=64, kv_bytes_per_seq=10e6,
        attention_flops_per_seq=10e6, peak_flops=1e12, bandwidth=10e9,
    )  # fmt: skip
    assert compute == pytest.approx(0.0128 + 0.00064)


def test_attention_flops_count_both_products_over_the_causal_triangle() -> None:
    # Token i of a prompt attends to tokens 1..i: 1 + 2 + 3 pairs for 3 tokens.
    assert causal_pairs(3) == 6 and causal_pairs(1) == 1 and causal_pairs(0) == 0
    # QK^T and PV: a multiply and an add per query-width element each, in every layer. The small
    # model (12 layers, 12 x 64 query width) at 273 tokens of context: ~10 MFLOP a sequence.
    assert attention_flops(layers=12, query_width=768, pairs=273) == 4 * 12 * 768 * 273


def test_weight_counts_are_the_decoder_projections_and_the_lm_head(tiny_llama_dir: Path) -> None:
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=1 << 24, max_model_len=64)
    cfg = llm.engine.model_config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    assert weight_counts(llm) == (cfg.num_layers * per_layer, cfg.vocab_size * h)


def test_a_gemm_rate_that_fell_during_the_run_is_its_spread() -> None:
    # fp32 fell from 190 to 150 GFLOP/s (21 %) while bf16 held (2 %): the run is flagged.
    noisy = gemm_spread(
        {"bfloat16": 420.0, "float32": 190.0}, {"bfloat16": 411.6, "float32": 150.0}
    )
    assert noisy == pytest.approx(40 / 190) and noisy > NOISY_SPREAD
    # Both rose a little (2 %, 3 %): the larger is the spread, under the threshold.
    quiet = gemm_spread(
        {"bfloat16": 420.0, "float32": 185.0}, {"bfloat16": 430.0, "float32": 190.0}
    )
    assert quiet == pytest.approx(5 / 190) and quiet < NOISY_SPREAD


def test_the_gemm_peak_is_the_faster_path_for_each_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.mm wins in bf16, oneDNN's packed linear in fp32 (MKL's fp32 mm on an AMD host): each
    # dtype's peak is its faster path, and both paths' rates are reported.
    def fake_measure(shapes, *, time_pass, budget_s):  # noqa: ANN001, ANN202
        if time_pass is time_packed_pass:
            return {"bfloat16": 400.0, "float32": 190.0}
        assert time_pass is time_gemm_pass
        return {"bfloat16": 420.0, "float32": 170.0}

    monkeypatch.setattr(roofline, "measure_gflops", fake_measure)
    best, by_path = gemm_peaks([GemmShape(8, 64, 64)])
    assert best == {"bfloat16": 420.0, "float32": 190.0}
    assert by_path["torch_mm"]["float32"] == 170.0
    assert by_path["onednn_packed"]["bfloat16"] == 400.0
