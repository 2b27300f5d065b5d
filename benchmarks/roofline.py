"""How close pdserve's engine runs to this host's roofline: prefill against the GEMM peak,
decode steps against max(compute, bytes read / memory bandwidth).

    python benchmarks/roofline.py [--model DIR] [--dtype auto] [--kv-cache-dtype auto]
        [--num-prompts 64]
        [--input-len 256] [--decode-steps 32] [--rounds 2] [--json OUT.json]

What it measures, in one process:
  host       CPU model, the instruction-set flags that matter here, torch threads, load average
             before and after (other processes on a shared host lower every figure);
  GEMM peak  GFLOP/s of one decoder layer's projections at 2,048 tokens in bf16 and fp32
             (``dtype_choice.measure_gflops``, best pass, before and after the engine run: the
             better of the two), each the faster of two paths: ``torch.mm`` on plain weights
             and oneDNN's packed linear (``dtype_choice.time_packed_pass``, the engine's own
             prefill GEMM and what ``--dtype auto`` times, which outran MKL's fp32 ``mm`` on
             the AMD host with AVX512-BF16 switched off: prefill read 99-101 % of a roofline of
             ``mm`` alone). The peak is the faster dtype's. Where a dtype's two measurements
             differ by more than ``NOISY_SPREAD``, the report warns that other load fell on the
             run;
  bandwidth  a 512 MiB ``copy_``, best of several, before and after: (bytes read + bytes
             written) / s; and a 512 MiB ``sum`` after: bytes read / s, reported beside the
             target (decode reads; on the Intel host of docs/benchmarks.md a read-only stream
             is slower than the copy's two streams);
  prefill    ``--num-prompts`` prompts of ``--input-len`` random tokens submitted at once, from
             the first step until every request has its first token; tok/s = prompt tokens / s.
             Those steps also carry the decodes of requests admitted earlier (one token each);
  decode     the following steps, each a decode of every request (no prefill left), median.
  Both run ``--rounds`` times on the same engine, and each keeps its best round (the fastest
  prefill, the lowest median step), as the GEMM peak keeps its best pass: a burst of load from
  other processes during one round then lowers neither the roofline nor the figures measured
  against it.

What the roofline counts (the linears and attention's own products, as model FLOPs utilisation
counts them, PaLM's appendix B; for a prefill, over the causal triangle only):
  prefill FLOPs  2 x (decoder linear weights) x prompt tokens, plus attention's products over the
                 causal triangle: QK^T and PV, 2 x 2 x layers x query width for each (query,
                 key) pair, a prompt of n tokens having n (n + 1) / 2 pairs (~3 % at 256-token
                 prompts on the small model). Left out: the lm_head (run on one row a request),
                 norms, RoPE and the sampler;
  decode FLOPs   2 x (decoder linear weights + lm_head) x sequences, plus attention's products
                 over each sequence's whole context (4 x layers x query width x context a
                 sequence: ~5 % at 64 sequences x 273 tokens on the small model);
  decode bytes   the decoder linear weights and the lm_head once (compute dtype), plus every
                 sequence's K and V for its whole context (in the KV cache dtype, which
                 ``--kv-cache-dtype auto`` makes bfloat16 on CPU); the embedding rows,
                 activations and writes are left out;
  decode bound   max(FLOPs / GEMM peak, bytes / bandwidth); also printed with the read
                 bandwidth in place of the copy's (information, not the target).
  Until the eighteenth pass of docs/benchmarks.md the FLOPs were the linears' alone; the report
  prints the fractions of that narrower roofline too ("linears only"), to compare with earlier
  figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.dtype_choice import (  # noqa: E402
    GemmShape,
    measure_gflops,
    model_gemm_shapes,
    time_gemm_pass,
    time_packed_pass,
)
from services.host_memory import heap_on_huge_pages, restart_with_huge_page_heap  # noqa: E402
from services.models.config import ModelConfig  # noqa: E402
from services.models.cpu_features import cpu_flags  # noqa: E402
from services.models.packed_linear import PackedLinear, PackedSiluGateUp  # noqa: E402
from services.models.tiny import build_tiny_model  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "small-llama"
FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def copy_bandwidth(num_bytes: int = 512 << 20, trials: int = 8) -> float:
    """Bytes read plus bytes written per second by ``copy_`` of a large buffer, best trial."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def read_bandwidth(num_bytes: int = 512 << 20, trials: int = 8) -> float:
    """Bytes read per second by ``sum`` of a large float32 buffer, best trial: what a kernel
    that only reads (a decode step, nearly) could stream here, for comparison with the copy."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    src.sum()  # fault the pages in
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def gemm_peaks(
    shapes: Sequence[GemmShape],
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """GFLOP/s per dtype, the faster of ``torch.mm`` and oneDNN's packed linear, and each
    path's own rates (``{"torch_mm": ..., "onednn_packed": ...}``)."""
    by_path = {
        "torch_mm": measure_gflops(shapes, time_pass=time_gemm_pass, budget_s=3.0),
        "onednn_packed": measure_gflops(shapes, time_pass=time_packed_pass, budget_s=3.0),
    }
    best = {name: max(rates[name] for rates in by_path.values()) for name in by_path["torch_mm"]}
    return best, by_path


NOISY_SPREAD = 0.10
"""A dtype's GEMM rate measured this much lower at one end of the run than at the other: the
report says that other load fell on the run (a shared host), so its fractions are not to be
compared with a quiet run's."""


def gemm_spread(before: dict[str, float], after: dict[str, float]) -> float:
    """The largest fall, over the dtypes, from the better of a dtype's two GEMM measurements to
    the worse, as a fraction of the better (0.0: the two agree)."""
    return max(
        1 - min(before[name], after[name]) / max(before[name], after[name]) for name in before
    )


def weight_counts(llm: LLM) -> tuple[int, int]:
    """(decoder linear weights, lm_head weights): parameters a token's matmuls touch. Counted
    from the modules' shapes: packed linears (``packed_linear.py``) hold no parameters."""
    decoder = lm_head = 0
    for name, module in llm.engine.runner.model.named_modules():
        if isinstance(module, (PackedLinear, PackedSiluGateUp)):
            weights = module.num_weights
        elif isinstance(module, torch.nn.Linear):
            weights = module.in_features * module.out_features
        else:
            continue
        if name.startswith("lm_head"):
            lm_head += weights
        elif ".layers." in name:
            decoder += weights
    return decoder, lm_head


def attention_flops(*, layers: int, query_width: int, pairs: float) -> float:
    """FLOPs of attention's two products over `pairs` (query token, key token) pairs: QK^T and
    PV each multiply and add a query-width row per pair in every layer."""
    return 4 * layers * query_width * pairs


def causal_pairs(prompt_len: int) -> int:
    """(query, key) pairs of a causal prefill: token i (from 1) attends to i tokens."""
    return prompt_len * (prompt_len + 1) // 2


def decode_bound_s(
    *,
    weights: int,
    itemsize: int,
    num_seqs: int,
    kv_bytes_per_seq: float,
    attention_flops_per_seq: float,
    peak_flops: float,
    bandwidth: float,
) -> tuple[float, float]:
    """(compute, memory) seconds of one decode step: 2 FLOPs per weight per sequence plus each
    sequence's attention products at the GEMM peak; the weights once plus every sequence's K/V
    at the copy bandwidth."""
    compute = (2 * weights + attention_flops_per_seq) * num_seqs / peak_flops
    memory = (weights * itemsize + num_seqs * kv_bytes_per_seq) / bandwidth
    return compute, memory


@dataclass(frozen=True)
class EngineRun:
    dtype: str
    dtype_source: str
    itemsize: int
    kv_cache_dtype: str
    kv_itemsize: int
    prefill_seconds: float
    """The fastest round's."""
    prefill_tok_per_s: float
    decode_step_seconds: list[float]
    """The steps of the round with the lowest median."""
    decode_step_median_s: float
    rounds: int
    decoder_weights: int
    lm_head_weights: int


def run_engine(args: argparse.Namespace) -> EngineRun:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.input_len + args.decode_steps + 8,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(16, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    warm_up = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:2], warm_up, use_tqdm=False)
    params = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True)
    prefill_s = float("inf")
    step_times: list[float] = []
    for round_index in range(args.rounds):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"roofline-{round_index}-{i}", prompt, params)
        first_token: set[str] = set()
        start = time.perf_counter()
        while len(first_token) < len(prompts):
            for output in engine.step():
                if output.new_token_ids:
                    first_token.add(output.request_id)
        prefill_s = min(prefill_s, time.perf_counter() - start)
        round_steps: list[float] = []
        while engine.has_unfinished_requests:
            step_start = time.perf_counter()
            engine.step()
            round_steps.append(time.perf_counter() - step_start)
        if not step_times or statistics.median(round_steps) < statistics.median(step_times):
            step_times = round_steps
    decoder, lm_head = weight_counts(llm)
    return EngineRun(
        dtype=engine.dtype_choice.dtype,
        dtype_source=engine.dtype_choice.source,
        itemsize=engine.runner.dtype.itemsize,
        kv_cache_dtype=engine.kv_dtype_choice.dtype,
        kv_itemsize=engine.runner.kv_cache_dtype.itemsize,
        prefill_seconds=prefill_s,
        prefill_tok_per_s=args.num_prompts * args.input_len / prefill_s,
        decode_step_seconds=step_times,
        decode_step_median_s=statistics.median(step_times),
        rounds=args.rounds,
        decoder_weights=decoder,
        lm_head_weights=lm_head,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "fp8_e5m2"]
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--rounds", type=int, default=2, help="engine runs of the workload; each figure's best"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not (args.model / "config.json").is_file():
        if args.model != DEFAULT_MODEL:
            parser.error(f"{args.model} is not a model directory")
        build_tiny_model(args.model, arch="llama", size="small")

    flags = cpu_flags()
    load_before = os.getloadavg()
    cfg = ModelConfig.from_model_path(args.model)
    shapes = model_gemm_shapes(cfg, args.max_num_batched_tokens)
    # The peaks are measured before and after the engine run and the better kept: on a shared
    # host a burst of load during one measurement would otherwise lower the roofline and flatter
    # the fractions.
    gflops_before, paths_before = gemm_peaks(shapes)
    bandwidth_before = copy_bandwidth()
    engine = run_engine(args)
    gflops_after, paths_after = gemm_peaks(shapes)
    bandwidth = max(bandwidth_before, copy_bandwidth())
    read_rate = read_bandwidth()
    gflops = {name: max(rate, gflops_after[name]) for name, rate in gflops_before.items()}
    spread = gemm_spread(gflops_before, gflops_after)
    peak_dtype = max(gflops, key=lambda name: gflops[name])
    peak = gflops[peak_dtype] * 1e9
    load_after = os.getloadavg()

    decoder, lm_head = engine.decoder_weights, engine.lm_head_weights
    query_width = cfg.num_heads * cfg.head_dim
    # Prefill roofline in tokens/s: 2 FLOPs per decoder linear weight per token, plus the
    # prompt's causal attention products spread over its tokens, at the peak.
    prefill_attention = (
        attention_flops(
            layers=cfg.num_layers, query_width=query_width, pairs=causal_pairs(args.input_len)
        )
        / args.input_len
    )
    prefill_roof = peak / (2 * decoder + prefill_attention)
    prefill_fraction = engine.prefill_tok_per_s / prefill_roof
    prefill_fraction_linears = engine.prefill_tok_per_s / (peak / (2 * decoder))
    # Decode: the mean context over the timed steps (prompt + tokens generated so far).
    num_seqs, itemsize = args.num_prompts, engine.itemsize
    mean_context = args.input_len + 1 + len(engine.decode_step_seconds) / 2
    kv_bytes = (
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.kv_itemsize * mean_context
    )

    def bound(attention_per_seq: float) -> tuple[float, float]:
        return decode_bound_s(
            weights=decoder + lm_head,
            itemsize=itemsize,
            num_seqs=num_seqs,
            kv_bytes_per_seq=kv_bytes,
            attention_flops_per_seq=attention_per_seq,
            peak_flops=peak,
            bandwidth=bandwidth,
        )

    decode_compute_s, decode_memory_s = bound(
        attention_flops(layers=cfg.num_layers, query_width=query_width, pairs=mean_context)
    )
    decode_bound = max(decode_compute_s, decode_memory_s)
    decode_ratio = engine.decode_step_median_s / decode_bound
    decode_ratio_linears = engine.decode_step_median_s / max(bound(0.0))
    # The same bound at the read bandwidth (information beside the target, which divides by the
    # copy's): the bytes a step reads, streamed as fast as a plain sum reads here.
    read_memory_s = decode_memory_s * bandwidth / read_rate
    read_bound = max(decode_compute_s, read_memory_s)

    flags_seen = [flag for flag in FLAGS_OF_INTEREST if flag in flags]
    host = {
        "cpu": cpu_model(),
        "flags": flags_seen,
        "torch_threads": torch.get_num_threads(),
        "heap_on_huge_pages": heap_on_huge_pages(),
        "load_average_before": load_before,
        "load_average_after": load_after,
    }
    report = {
        "host": host,
        "gemm_gflops": gflops,
        "gemm_gflops_before_after": [gflops_before, gflops_after],
        "gemm_gflops_by_path_before_after": [paths_before, paths_after],
        "gemm_spread": spread,
        "peak_dtype": peak_dtype,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "read_bandwidth_gb_s": read_rate / 1e9,
        "engine": {k: v for k, v in asdict(engine).items() if k != "decode_step_seconds"},
        "prefill_roofline_tok_per_s": prefill_roof,
        "prefill_fraction": prefill_fraction,
        "prefill_fraction_linears_only": prefill_fraction_linears,
        "decode_compute_ms": decode_compute_s * 1e3,
        "decode_memory_ms": decode_memory_s * 1e3,
        "decode_bound_ms": decode_bound * 1e3,
        "decode_ratio": decode_ratio,
        "decode_ratio_linears_only": decode_ratio_linears,
        "decode_bound_at_read_bandwidth_ms": read_bound * 1e3,
        "decode_ratio_at_read_bandwidth": engine.decode_step_median_s / read_bound,
    }
    print(f"host: {host['cpu']}, {host['torch_threads']} threads, flags {' '.join(flags_seen)}")
    print(f"glibc heap on huge pages: {'yes' if host['heap_on_huge_pages'] else 'no'}")
    print(f"load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    rates = ", ".join(
        f"{name} {rate:.0f} (before {gflops_before[name]:.0f}, after {gflops_after[name]:.0f})"
        for name, rate in gflops.items()
    )
    print(f"GEMM at the model's shapes (GFLOP/s): {rates}; peak {peak_dtype}")
    by_path = ", ".join(
        f"{name} torch.mm {max(paths_before['torch_mm'][name], paths_after['torch_mm'][name]):.0f}"
        f" / oneDNN packed "
        f"{max(paths_before['onednn_packed'][name], paths_after['onednn_packed'][name]):.0f}"
        for name in gflops
    )
    print(f"  by path (the better of before and after): {by_path}")
    if spread > NOISY_SPREAD:
        print(
            f"warning: a GEMM rate fell {spread:.0%} between the two measurements: other load "
            "fell on this run; compare its figures only with runs that show no such fall"
        )
    print(
        f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write); "
        f"read bandwidth: {read_rate / 1e9:.1f} GB/s (sum)"
    )
    print(
        f"engine dtype: {engine.dtype} ({engine.dtype_source}), KV cache {engine.kv_cache_dtype}; "
        f"best of {engine.rounds} round(s) below"
    )
    print(
        f"prefill: {engine.prefill_tok_per_s:.0f} tok/s of a {prefill_roof:.0f} tok/s roofline "
        f"= {prefill_fraction:.0%} (target >= 85 %); linears only: {prefill_fraction_linears:.0%}"
    )
    print(
        f"decode step ({num_seqs} seqs, ~{mean_context:.0f} context): "
        f"{engine.decode_step_median_s * 1e3:.1f} ms; bound {decode_bound * 1e3:.1f} ms "
        f"(compute {decode_compute_s * 1e3:.1f}, memory {decode_memory_s * 1e3:.1f}) = "
        f"{decode_ratio:.2f}x (target <= 1.3x); at the read bandwidth: bound "
        f"{read_bound * 1e3:.1f} ms = {engine.decode_step_median_s / read_bound:.2f}x; "
        f"linears only: {decode_ratio_linears:.2f}x"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    restart_with_huge_page_heap()  # as the nodes run: services/host_memory.py
    main()
