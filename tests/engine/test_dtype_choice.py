"""``dtype="auto"``: the faster dtype by (injected) timing, the per-CPU cache read back, an
explicit dtype winning, and an engine that computes and lays out its KV in the chosen dtype."""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services.engine import EngineConfig, SchedulerConfig
from services.engine import dtype_choice as dc
from services.engine.dtype_choice import (
    DtypeChoice,
    GemmShape,
    choose_compute_dtype,
    measure_gflops,
    model_gemm_shapes,
)
from services.engine.engine_core import EngineCore
from services.models.config import ModelConfig
from services.models.gguf_file import open_gguf
from services.models.packed_linear import packing_unavailable_reason

SHAPES = (GemmShape(64, 32, 96), GemmShape(64, 96, 32))
FLOPS = sum(s.flops for s in SHAPES)


class FakeTimer:
    """Seconds per pass by dtype; counts the passes it was asked for."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.calls: list[str] = []

    def __call__(self, dtype: str, shapes: Sequence[GemmShape]) -> float:
        assert tuple(shapes) == SHAPES
        self.calls.append(dtype)
        return self.seconds[dtype]


def never_timed(dtype: str, shapes: Sequence[GemmShape]) -> float:
    raise AssertionError("nothing should have been measured")


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        ({"bfloat16": 0.2, "float32": 0.1}, "float32"),  # issue 21's Intel host
        ({"bfloat16": 0.1, "float32": 0.2}, "bfloat16"),  # the AMD host
    ],
)
def test_auto_picks_the_faster_dtype(tmp_path: Path, seconds, expected) -> None:
    timer = FakeTimer(seconds)
    choice = choose_compute_dtype("auto", "cpu", SHAPES, cache_dir=tmp_path, time_pass=timer)
    assert choice.dtype == expected and choice.source == "measured"
    assert choice.gflops == pytest.approx({name: FLOPS / s / 1e9 for name, s in seconds.items()})


def test_rate_is_each_dtypes_best_pass_and_the_budget_bounds_the_rounds() -> None:
    # bf16 has one slow outlier pass (another process took the core): its best pass counts.
    passes = iter([9.0, 1.0, 5.0, 1.0, 0.5, 1.0, 0.5, 1.0] + [0.5, 1.0] * 100)

    def timer(dtype: str, shapes: Sequence[GemmShape]) -> float:
        return next(passes)

    rates = measure_gflops(SHAPES, time_pass=timer, budget_s=4.0)
    assert rates["bfloat16"] == pytest.approx(FLOPS / 0.5 / 1e9)
    assert rates["float32"] == pytest.approx(FLOPS / 1.0 / 1e9)
    # A warm-up pass each (not counted), then rounds of one pass each until 4 s of timed work:
    # 5 + 1 + 0.5 + 1 = 7.5 s after the minimum of two rounds, so 6 passes in all.
    assert next(passes) == 0.5  # the 7th was never taken


def test_the_measurement_is_cached_per_cpu_and_read_back(tmp_path: Path) -> None:
    timer = FakeTimer({"bfloat16": 0.2, "float32": 0.1})
    first = choose_compute_dtype("auto", "cpu", SHAPES, cache_dir=tmp_path, time_pass=timer)
    (cache_file,) = tmp_path.glob("pdserve_dtype_*.json")
    second = choose_compute_dtype("auto", "cpu", SHAPES, cache_dir=tmp_path, time_pass=never_timed)
    assert second == DtypeChoice("float32", "cached", first.gflops)
    # Other shapes (another model, another chunk size) are measured on their own; both kept.
    other = (GemmShape(8, 8, 8),)
    choose_compute_dtype("auto", "cpu", other, cache_dir=tmp_path, time_pass=lambda d, s: 1.0)
    assert len(json.loads(cache_file.read_text())) == 2


def test_a_damaged_cache_is_measured_again(tmp_path: Path) -> None:
    timer = FakeTimer({"bfloat16": 0.1, "float32": 0.2})
    choose_compute_dtype("auto", "cpu", SHAPES, cache_dir=tmp_path, time_pass=timer)
    (cache_file,) = tmp_path.glob("pdserve_dtype_*.json")
    cache_file.write_text("{not json")
    timer.calls.clear()
    choice = choose_compute_dtype("auto", "cpu", SHAPES, cache_dir=tmp_path, time_pass=timer)
    assert choice.source == "measured" and choice.dtype == "bfloat16" and timer.calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_always_wins(tmp_path: Path, dtype: str) -> None:
    choice = choose_compute_dtype(dtype, "cpu", SHAPES, cache_dir=tmp_path, time_pass=never_timed)
    assert choice == DtypeChoice(dtype, "explicit")
    assert not list(tmp_path.iterdir())


def test_auto_on_cuda_is_bfloat16_unmeasured(tmp_path: Path) -> None:
    choice = choose_compute_dtype(
        "auto", "cuda:0", SHAPES, cache_dir=tmp_path, time_pass=never_timed
    )
    assert choice == DtypeChoice("bfloat16", "cuda default")


def test_the_real_timer_measures_both_dtypes() -> None:
    rates = measure_gflops((GemmShape(16, 32, 32),), budget_s=0.0)
    assert set(rates) == {"bfloat16", "float32"} and all(rate > 0 for rate in rates.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_packed_pass_runs_the_engines_gemm_and_keeps_its_operands_until_measured(
    dtype: str,
) -> None:
    shapes = (GemmShape(16, 64, 128), GemmShape(16, 128, 64))
    assert dc.time_packed_pass(dtype, shapes) > 0.0
    if packing_unavailable_reason(torch.device("cpu"), getattr(torch, dtype)) is not None:
        assert dc._packed_cache == {}  # timed with torch.mm, as the engine would not pack it
        dc._operand_cache.clear()
        return
    first = dc._packed_cache[(dtype, shapes)]
    # What it multiplies: the plain pass's operands, the weight in oneDNN's layout.
    for (x, packed), (plain_x, weight_t) in zip(
        first, dc.gemm_operands(dtype, shapes), strict=True
    ):
        assert x is plain_x
        product = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        torch.testing.assert_close(product, torch.mm(x, weight_t), rtol=2e-2, atol=2e-2)
    dc.time_packed_pass(dtype, shapes)
    assert dc._packed_cache[(dtype, shapes)] is first  # the second pass reused the buffers
    measure_gflops(shapes, budget_s=0.0)
    assert dc._packed_cache == {} and dc._operand_cache == {}


def test_auto_times_the_packed_pass_unless_told_otherwise() -> None:
    for function in (choose_compute_dtype, measure_gflops):
        default = inspect.signature(function).parameters["time_pass"].default
        assert default is dc.time_packed_pass, function.__name__


def test_rates_cached_before_the_packed_pass_are_measured_again(tmp_path: Path) -> None:
    # A cache written when auto timed torch.mm: its key lacks the path, so it is not read.
    old_key = dc._cache_key(SHAPES).removeprefix(dc.CACHE_KEY_PATH + " ")
    cache_file = tmp_path / f"pdserve_dtype_{dc.cpu_tag()}.json"
    cache_file.write_text(json.dumps({old_key: {"bfloat16": 900.0, "float32": 1.0}}))
    timer = FakeTimer({"bfloat16": 0.2, "float32": 0.1})
    choice = choose_compute_dtype("auto", "cpu", SHAPES, cache_dir=tmp_path, time_pass=timer)
    assert choice.dtype == "float32" and choice.source == "measured" and timer.calls


def test_shapes_are_one_layers_projections_at_the_chunk_size(tiny_llama_dir: Path) -> None:
    cfg = ModelConfig.from_model_dir(tiny_llama_dir)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    assert model_gemm_shapes(cfg, 300) == (
        GemmShape(300, h, q + 2 * kv),
        GemmShape(300, q, h),
        GemmShape(300, h, 2 * i),
        GemmShape(300, i, h),
    )
    assert model_gemm_shapes(cfg, 10**6)[0].m == dc.MAX_MEASURED_TOKENS


def make_auto_engine(
    model_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, faster: str
) -> EngineCore:
    """An engine with ``dtype="auto"`` on the CPU whose cache (in ``cache_dir``) was seeded with
    ``faster`` the faster dtype (this host's real rates may say otherwise)."""
    config = EngineConfig(
        model_dir=model_path,
        dtype="auto",
        attention_backend="torch",
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    )
    shapes = model_gemm_shapes(ModelConfig.from_model_path(model_path), 64)
    choose_compute_dtype(
        "auto",
        "cpu",
        shapes,
        cache_dir=cache_dir,
        time_pass=lambda dtype, s: 0.1 if dtype == faster else 0.3,
    )
    monkeypatch.setattr(dc, "cpu_cache_dir", lambda: cache_dir)
    return EngineCore(config)


def test_an_auto_engine_computes_in_the_cached_choice_over_a_bf16_kv_cache(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_auto_engine(tiny_llama_dir, tmp_path, monkeypatch, faster="float32")
    assert engine.dtype_choice.dtype == "float32" and engine.dtype_choice.source == "cached"
    assert engine.runner.dtype == torch.float32
    # The KV cache dtype is chosen on its own: bfloat16 on CPU under an fp32 compute dtype.
    assert engine.kv_dtype_choice.dtype == "bfloat16"
    assert all(cache.dtype == torch.bfloat16 for cache in engine.kv_caches)
    assert engine.kv_layout.dtype == "bfloat16"


def test_auto_on_cpu_computes_a_quantized_checkpoint_in_float32_unmeasured(
    tmp_path: Path,
) -> None:
    choice = choose_compute_dtype(
        "auto", "cpu", SHAPES, quantized_checkpoint=True, cache_dir=tmp_path, time_pass=never_timed
    )
    assert choice == DtypeChoice("float32", "quantized checkpoint")
    # An explicit dtype still wins, and CUDA keeps its default.
    explicit = choose_compute_dtype(
        "bfloat16", "cpu", SHAPES, quantized_checkpoint=True, time_pass=never_timed
    )
    assert explicit == DtypeChoice("bfloat16", "explicit")
    cuda = choose_compute_dtype(
        "auto", "cuda:0", SHAPES, quantized_checkpoint=True, time_pass=never_timed
    )
    assert cuda == DtypeChoice("bfloat16", "cuda default")


@pytest.mark.parametrize(("qtype", "quantized"), [("Q8_0", True), ("F16", False)])
def test_an_auto_engine_on_a_gguf_computes_in_float32_only_when_it_is_quantized(
    tiny_gguf_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str, quantized: bool
) -> None:
    gguf_path = tiny_gguf_factory("llama", qtype)
    assert open_gguf(gguf_path).is_quantized == quantized
    # This CPU's cache says bfloat16 is the faster, so only the quantized rule makes float32.
    engine = make_auto_engine(gguf_path, tmp_path, monkeypatch, faster="bfloat16")
    expected = ("float32", "quantized checkpoint") if quantized else ("bfloat16", "cached")
    assert (engine.dtype_choice.dtype, engine.dtype_choice.source) == expected
    assert engine.runner.dtype == getattr(torch, expected[0])
