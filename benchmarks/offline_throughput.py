"""Offline throughput: pdserve's engine against transformers ``generate()`` with static batches.

    python benchmarks/offline_throughput.py [--model DIR|GGUF] [--num-prompts 64] [--input-len 256]
        [--output-len 64] [--dtype bfloat16|float32|auto] [--hf-dtype same|default|...]
        [--hf-batch-size 16] [--device cpu] [--quantization fp8] [--json OUT.json]

Both run in this process on the same random prompts (every prompt exactly ``--input-len``
tokens, so the static baseline pads nothing) and generate exactly ``--output-len`` tokens each
(EOS ignored). Prints output tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import LLM, SamplingParams  # noqa: E402
from services.host_memory import restart_with_huge_page_heap  # noqa: E402
from services.models.config import ModelConfig  # noqa: E402
from services.models.gguf_file import find_gguf  # noqa: E402
from services.models.tiny import build_tiny_model  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "small-llama"


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids: the tiny tokenizers put their special tokens there.
    return [[rng.randrange(16, vocab_size) for _ in range(length)] for _ in range(num)]


def results_dtype(args: argparse.Namespace) -> str:
    """The dtype pdserve computed in (``auto`` resolved), once its run is done."""
    return str(getattr(args, "pdserve_dtype", args.dtype))


def run_pdserve(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # random prompts share nothing; keep the comparison plain
        quantization=args.quantization,
    )
    args.pdserve_dtype = llm.engine.dtype_choice.dtype
    budget = llm.engine.config.scheduler.max_num_batched_tokens
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # Warm-up at the run's prompt length and a full step's chunks: on a GPU each kernel shape
    # met first compiles (Triton) or picks its algorithm (cuBLAS) inside the timed run otherwise.
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    profile = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if profile is not None:
        profile.disable()
    elapsed = time.perf_counter() - start
    if profile is not None:
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(30)
        args.profile.write_text(text.getvalue())
    num_out = sum(len(o.token_ids) for o in outputs)
    return {
        "seconds": elapsed,
        "output_tokens": num_out,
        "output_tok_per_s": num_out / elapsed,
        "max_num_batched_tokens": budget,
    }


def run_hf(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    # "default": what transformers picks when not told (the checkpoint's dtype in 5.x).
    hf_dtype = args.dtype if args.hf_dtype == "same" else args.hf_dtype
    if hf_dtype == "auto":
        hf_dtype = results_dtype(args)
    options = {} if hf_dtype == "default" else {"dtype": getattr(torch, hf_dtype)}
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, **options)
    args.hf_dtype_used = str(model.dtype).removeprefix("torch.")
    model.to(args.device).eval()
    gen = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.inference_mode():
        warmup = torch.tensor(prompts[:2], device=args.device)
        model.generate(warmup, max_new_tokens=4, min_new_tokens=4, **gen)
        start = time.perf_counter()
        num_out = 0
        for i in range(0, len(prompts), args.hf_batch_size):
            batch = torch.tensor(prompts[i : i + args.hf_batch_size], device=args.device)
            out = model.generate(
                batch, max_new_tokens=args.output_len, min_new_tokens=args.output_len, **gen
            )
            num_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        if args.device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "fp8_e5m2"],
        help="pdserve's KV cache dtype (auto: bfloat16 on CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--hf-dtype",
        default="same",
        choices=["same", "default", "float32", "bfloat16"],
        help="transformers' dtype: same as pdserve's, or default (what from_pretrained picks)",
    )
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N], for both systems")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="pdserve's step budget (default: the engine's for the device, 2048 on CPU)",
    )
    parser.add_argument(
        "--quantization", choices=["fp8"], default=None, help="pdserve's (fp8 projections)"
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--profile", type=Path, help="write a cProfile of pdserve's timed run here (host side)"
    )
    args = parser.parse_args()

    gguf = find_gguf(args.model) if args.model.exists() else None
    if gguf is not None:  # pdserve alone: transformers' side loads config.json checkpoints
        if not args.skip_hf:
            parser.error(f"{args.model} is a GGUF file: pass --skip-hf")
        vocab_size = ModelConfig.from_model_path(gguf).vocab_size
    else:
        if not (args.model / "config.json").is_file():
            if args.model != DEFAULT_MODEL:
                parser.error(f"{args.model} is not a model directory")
            print(f"building the small benchmark model into {args.model} ...", flush=True)
            build_tiny_model(args.model, arch="llama", size="small")
        vocab_size = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)

    results = {"config": {k: str(v) for k, v in vars(args).items()}}
    results["torch_threads"] = torch.get_num_threads()
    results["pdserve"] = run_pdserve(args, prompts)
    results["pdserve"]["dtype"] = args.pdserve_dtype
    print(
        f"pdserve ({args.pdserve_dtype}):   {results['pdserve']['output_tok_per_s']:8.1f} "
        f"output tok/s ({results['pdserve']['seconds']:.1f} s)",
        flush=True,
    )
    if not args.skip_hf:
        results["hf_static"] = run_hf(args, prompts)
        ratio = results["pdserve"]["output_tok_per_s"] / results["hf_static"]["output_tok_per_s"]
        results["ratio"] = ratio
        results["hf_static"]["dtype"] = args.hf_dtype_used
        print(
            f"transformers (bs={args.hf_batch_size}, {args.hf_dtype_used}): "
            f"{results['hf_static']['output_tok_per_s']:8.1f} output tok/s "
            f"({results['hf_static']['seconds']:.1f} s)"
        )
        print(f"ratio:                {ratio:8.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    restart_with_huge_page_heap()  # as the nodes run: services/host_memory.py
    main()
