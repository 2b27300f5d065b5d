"""``dtype="auto"``: compute in whichever of bfloat16 and float32 multiplies this model's
matrices faster on this CPU, measured once per CPU and cached.

Why: which is faster depends on the host, not on the model. On a 2-core AMD EPYC (AVX-512)
bf16 GEMMs ran ~2x fp32's rate; on a 2-core Intel host without AMX exposed bf16 ran at 152-170
GFLOP/s against fp32's 235-330 (issue 21), so a fixed default is slow on one of them.

Life cycle of a choice, once per engine start:
  1. an explicit dtype (``float32``, ``bfloat16``, ``float16``) is used as given;
  2. ``auto`` on CUDA is ``bfloat16`` (the default before ``auto`` existed; not measured);
  3. ``auto`` on CPU for a quantized checkpoint (a GGUF file of Q4_1, Q8_0, K-quants, ...,
     or an fp8 checkpoint, dequantized at load) is ``float32``, not measured (an fp8 value
     times its float32 scale is exact in fp32 too): a block's dequantized weights (its
     fp16 scale times a small integer, plus its fp16 minimum) are exact in fp32 and not in bf16
     (8 significant bits), so bf16 would add an error the file does not have. Measured on the
     default model: SmolLM2-135M-Instruct's first answer token to the README's question ("The"
     of "The capital of France is Paris.") leads the next ("L") by 0.08 logits in fp32, and in
     bf16 on the AMD EPYC host of ``docs/benchmarks.md`` (twelfth pass) the engine answered
     "L'Étoile, la Marseillaise, la femme, ..." instead. The price: the weights take twice
     bf16's memory and the GEMMs run at fp32's rate, so a large quantized model that must fit
     or be fast asks for ``bfloat16`` explicitly;
  4. ``auto`` on CPU otherwise reads the cache file for this CPU (named by
     ``kv_transfer.build_support.cpu_tag``), keyed by the GEMM shapes, torch's version and its
     thread count; a hit is used as it is;
  5. a miss times the shapes in both dtypes, alternating so that load from other processes
     falls on both, for about ``budget_s`` of GEMM time, keeps each dtype's best pass, writes
     the rates to the cache and picks the faster. A pass runs the GEMM the engine's prefill
     runs (``time_packed_pass``): oneDNN's packed linear where ``pack_linears`` packs that
     dtype, else ``torch.mm``. On the AMD host of ``docs/benchmarks.md`` (nineteenth pass)
     the packed path ran fp32 14-17 % and bf16 4 % faster than ``torch.mm`` (MKL's, in fp32);
     timing ``mm`` would measure a kernel the engine does not run.
Steps 4-5 hold an exclusive lock on the cache file, so that nodes started together on one
host measure once and agree. Nodes on different hosts may choose different compute dtypes;
that is harmless for disaggregation as long as their KV dtypes agree (below).

The KV cache dtype is chosen on its own (``choose_kv_cache_dtype``), after the compute dtype:
  1. an explicit ``kv_cache_dtype`` is used as given (with the Triton kernels, i.e. on CUDA,
     it must equal the compute dtype);
  2. ``auto`` on CPU is ``bfloat16`` whatever the compute dtype: decode is memory-bound (every
     step reads each context's whole K/V), so bf16 halves its traffic and the cache holds twice
     the tokens, while bf16 keeps fp32's exponent range (no overflow, unlike float16). Attention
     widens K/V to the query's dtype when it reads them and accumulates in fp32;
  3. ``auto`` on CUDA (or with the Triton backend) is the compute dtype: the Triton kernels
     read the cache in the query's dtype.
``fp8_e5m2`` (CPU only, never chosen by ``auto``) halves a bf16 cache's bytes again, at two
mantissa bits: E5M2 is an IEEE half's top byte, so the kernels widen it exactly and cheaply, and
it keeps half's exponent range (K/V beyond 57,344 in magnitude would overflow to inf). Decode
attention reads half the bytes and the cache holds twice the tokens; the outputs differ from a
bf16 cache's by the rounding of K/V to two mantissa bits (``docs/benchmarks.md``).
The KV dtype is part of the KV layout's fingerprint: a prefill and a decode node must agree on
it, and with ``auto`` two CPU nodes always do.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kv_transfer.build_support import cpu_tag
from services.engine.config import FP8_KV_DTYPE, FP8_ON_CPU_ONLY
from services.models.config import ModelConfig
from services.models.cpu_features import cpu_cache_dir
from services.models.packed_linear import REORDER_BATCH_HINT, packing_unavailable_reason
from services.types import EngineConfigError

logger = logging.getLogger(__name__)

CANDIDATE_DTYPES = ("bfloat16", "float32")
CUDA_AUTO_DTYPE = "bfloat16"
QUANTIZED_CHECKPOINT_DTYPE = "float32"
"""``auto`` on CPU for a quantized checkpoint: the dtype its dequantized weights are exact in."""
MAX_MEASURED_TOKENS = 2048
"""Rows of the timed GEMMs at most: a prefill chunk's rate is reached well before this."""
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class GemmShape:
    """``[m, k] @ [k, n]``: m tokens through a k -> n projection."""

    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    """The compute dtype to use: never ``auto``."""
    source: str
    """``explicit``, ``cuda default``, ``quantized checkpoint``, ``cached`` or ``measured``."""
    gflops: Mapping[str, float] = field(default_factory=dict)
    """GEMM rate per candidate dtype, GFLOP/s; empty when nothing was measured."""

    def describe(self) -> str:
        rates = ", ".join(f"{name} {rate:.0f} GFLOP/s" for name, rate in self.gflops.items())
        return f"{self.dtype} ({self.source}{': ' + rates if rates else ''})"


@dataclass(frozen=True)
class KvDtypeChoice:
    dtype: str
    """The dtype the KV cache holds: never ``auto``."""
    reason: str
    """Why, for the log and the ``pdserve:kv_cache_dtype_info`` metric's ``source`` label:
    ``explicit``, ``cpu default`` or ``compute dtype``."""

    def describe(self) -> str:
        return f"{self.dtype} ({self.reason})"


CPU_AUTO_KV_DTYPE = "bfloat16"


def choose_kv_cache_dtype(
    requested: str, compute_dtype: str, device: str, attention_backend: str = "auto"
) -> KvDtypeChoice:
    """Resolve ``requested`` (``auto`` or a dtype name) given the resolved compute dtype; see
    the module docstring. A cache dtype other than the compute dtype needs the torch or native
    attention on the CPU; elsewhere ``auto`` is the compute dtype and anything else raises
    ``EngineConfigError`` naming ``kv_cache_dtype``."""
    if compute_dtype == "auto":
        raise ValueError("choose_kv_cache_dtype needs the resolved compute dtype, got 'auto'")
    # The Triton kernels (CUDA, or the CPU interpreter in tests) read K/V in the query's dtype.
    mixed_ok = device == "cpu" and attention_backend != "triton"
    if requested == "auto":
        if mixed_ok:
            return KvDtypeChoice(CPU_AUTO_KV_DTYPE, "cpu default")
        return KvDtypeChoice(compute_dtype, "compute dtype")
    if requested not in ("float32", "bfloat16", "float16", FP8_KV_DTYPE):
        raise EngineConfigError(
            "kv_cache_dtype must be auto, float32, bfloat16, float16 or fp8_e5m2, "
            f"got {requested!r}"
        )
    if requested == FP8_KV_DTYPE and not mixed_ok:
        raise EngineConfigError(FP8_ON_CPU_ONLY)
    if device == "cpu" and requested == "float16":
        raise EngineConfigError(
            "kv_cache_dtype float16 is supported on GPU only; use bfloat16 or float32"
        )
    if not mixed_ok and requested != compute_dtype:
        raise EngineConfigError(
            f"kv_cache_dtype {requested} differs from the compute dtype {compute_dtype}: the "
            "Triton attention kernels read the cache in the compute dtype; use kv_cache_dtype auto"
        )
    return KvDtypeChoice(requested, "explicit")


PassTimer = Callable[[str, Sequence[GemmShape]], float]
"""Seconds one pass over the shapes takes in a dtype; injected by tests."""


def model_gemm_shapes(model_config: ModelConfig, num_tokens: int) -> tuple[GemmShape, ...]:
    """The matrix products of one decoder layer for a chunk of ``num_tokens`` tokens (capped
    at ``MAX_MEASURED_TOKENS``): fused QKV, output, fused gate/up, and down projections."""
    cfg = model_config
    m = max(1, min(num_tokens, MAX_MEASURED_TOKENS))
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return (
        GemmShape(m, h, q + 2 * kv),
        GemmShape(m, q, h),
        GemmShape(m, h, 2 * i),
        GemmShape(m, i, h),
    )


def time_gemm_pass(dtype: str, shapes: Sequence[GemmShape]) -> float:
    """Wall seconds of one ``torch.mm`` per shape in ``dtype`` on the CPU, operands prepared
    outside the timed part and kept until ``measure_gflops`` ends, so passes reuse them."""
    operands = gemm_operands(dtype, tuple(shapes))
    start = time.perf_counter()
    for a, b in operands:
        torch.mm(a, b)
    return time.perf_counter() - start


_Operands = dict[tuple[str, tuple[GemmShape, ...]], list[tuple[torch.Tensor, torch.Tensor]]]
_operand_cache: _Operands = {}
_packed_cache: _Operands = {}


def gemm_operands(
    dtype: str, shapes: tuple[GemmShape, ...]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per shape, random ``x [m, k]`` and ``weight.T [k, n]`` (the weight stored ``[n, k]``, as
    ``nn.Linear`` keeps it) in ``dtype``, made once and kept until ``measure_gflops`` ends."""
    key = (dtype, shapes)
    if key not in _operand_cache:
        generator = torch.Generator().manual_seed(0)
        torch_dtype = _TORCH_DTYPES[dtype]
        _operand_cache[key] = [
            (
                torch.randn(s.m, s.k, generator=generator).to(torch_dtype),
                # Weights are stored [n, k] and used transposed, as nn.Linear does.
                torch.randn(s.n, s.k, generator=generator).to(torch_dtype).t(),
            )
            for s in shapes
        ]
    return _operand_cache[key]


def time_packed_pass(dtype: str, shapes: Sequence[GemmShape]) -> float:
    """Wall seconds of one pass over the shapes in ``dtype`` on the GEMM the engine's prefill
    runs: oneDNN's packed linear (``PackedLinear`` past the few-row kernels), each weight
    reordered once outside the timed part as ``pack_linears`` does, or ``time_gemm_pass``
    (``torch.mm``) where the engine would not pack ``dtype`` here. The packed weights are kept
    until ``measure_gflops`` ends, as the plain operands are."""
    if packing_unavailable_reason(torch.device("cpu"), _TORCH_DTYPES[dtype]) is not None:
        return time_gemm_pass(dtype, shapes)
    key = (dtype, tuple(shapes))
    if key not in _packed_cache:
        _packed_cache[key] = [
            (x, torch.ops.mkldnn._reorder_linear_weight(weight_t.t(), REORDER_BATCH_HINT))
            for x, weight_t in gemm_operands(dtype, key[1])
        ]
    operands = _packed_cache[key]
    start = time.perf_counter()
    for x, packed in operands:
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return time.perf_counter() - start


def measure_gflops(
    shapes: Sequence[GemmShape],
    *,
    time_pass: PassTimer = time_packed_pass,
    budget_s: float = 1.0,
    min_rounds: int = 2,
    max_rounds: int = 50,
) -> dict[str, float]:
    """Best GFLOP/s per candidate dtype over alternating passes: one warm-up pass each, then
    rounds of one pass per dtype until ``budget_s`` of timed work (at least ``min_rounds``)."""
    flops = sum(s.flops for s in shapes)
    best = {name: float("inf") for name in CANDIDATE_DTYPES}
    for name in CANDIDATE_DTYPES:
        time_pass(name, shapes)  # warm-up: allocation, oneDNN's kernel choice, caches
    spent = 0.0
    for round_index in range(max_rounds):
        if round_index >= min_rounds and spent >= budget_s:
            break
        for name in CANDIDATE_DTYPES:
            seconds = time_pass(name, shapes)
            spent += seconds
            best[name] = min(best[name], seconds)
    _operand_cache.clear()
    _packed_cache.clear()
    return {name: flops / max(seconds, 1e-12) / 1e9 for name, seconds in best.items()}


def faster_dtype(gflops: Mapping[str, float]) -> str:
    """The candidate with the highest rate; bfloat16 on a tie (half the memory)."""
    return max(CANDIDATE_DTYPES, key=lambda name: (gflops[name], name == "bfloat16"))


def choose_compute_dtype(
    requested: str,
    device: str,
    shapes: Sequence[GemmShape],
    *,
    quantized_checkpoint: bool = False,
    cache_dir: Path | None = None,
    time_pass: PassTimer = time_packed_pass,
    budget_s: float = 1.0,
) -> DtypeChoice:
    """Resolve ``requested`` (``auto`` or a dtype name) for ``device``; see the module's life
    cycle. ``quantized_checkpoint``: the weights come dequantized from a quantized file.
    ``cache_dir`` defaults to ``cpu_features.cpu_cache_dir()``."""
    if requested != "auto":
        return DtypeChoice(requested, "explicit")
    if device != "cpu":
        return DtypeChoice(CUDA_AUTO_DTYPE, "cuda default")
    if quantized_checkpoint:
        return DtypeChoice(QUANTIZED_CHECKPOINT_DTYPE, "quantized checkpoint")
    directory = cache_dir if cache_dir is not None else cpu_cache_dir()
    key = _cache_key(shapes)
    path = directory / f"pdserve_dtype_{cpu_tag()}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / f"pdserve_dtype_{cpu_tag()}.lock", "a")  # noqa: SIM115
    except OSError as exc:
        logger.warning("dtype cache %s is unusable (%s): measuring without it", directory, exc)
        rates = measure_gflops(shapes, time_pass=time_pass, budget_s=budget_s)
        return DtypeChoice(faster_dtype(rates), "measured", rates)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read_cache(path)
        cached = entries.get(key)
        if cached is not None:
            return DtypeChoice(faster_dtype(cached), "cached", cached)
        rates = measure_gflops(shapes, time_pass=time_pass, budget_s=budget_s)
        entries[key] = rates
        _write_cache(path, entries)
    return DtypeChoice(faster_dtype(rates), "measured", rates)


CACHE_KEY_PATH = "gemm=packed"
"""In every cache key: the rates of ``time_packed_pass``. Keys without it hold ``torch.mm``'s
rates (before the engine's own GEMM was timed) and are measured again."""


def _cache_key(shapes: Sequence[GemmShape]) -> str:
    dims = ";".join(f"{s.m}x{s.k}x{s.n}" for s in shapes)
    return (
        f"{CACHE_KEY_PATH} torch={torch.__version__} threads={torch.get_num_threads()} gemms={dims}"
    )


def _read_cache(path: Path) -> dict[str, dict[str, float]]:
    """The cached rates, or none: a missing or damaged file is measured again, not an error."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries: dict[str, dict[str, float]] = {}
    if isinstance(raw, dict):
        for key, rates in raw.items():
            if isinstance(rates, dict) and all(
                isinstance(rates.get(name), (int, float)) for name in CANDIDATE_DTYPES
            ):
                entries[str(key)] = {name: float(rates[name]) for name in CANDIDATE_DTYPES}
    return entries


def _write_cache(path: Path, entries: Mapping[str, Mapping[str, float]]) -> None:
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(entries, indent=1, sort_keys=True))
        temporary.replace(path)  # readers see the old file or the new one, never half of one
    except OSError as exc:
        logger.warning("cannot write the dtype cache %s: %s", path, exc)
