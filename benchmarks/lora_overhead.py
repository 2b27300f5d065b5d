"""LoRA's cost in the offline engine: one workload run with no LoRA, with LoRA on and every
request on the base model, every request on one adapter, and half on each of two adapters.

    python benchmarks/lora_overhead.py [--model DIR] [--num-prompts 64] [--input-len 128]
        [--output-len 32] [--rank 16] [--dtype auto] [--rounds 2] [--device cuda]
        [--kv-cache-memory 4GiB] [--eager]

The adapters are random (``services/models/random_lora.py``), of ``--rank`` on all seven
projections of every layer. Every run is the same random prompts, greedy, EOS ignored, prefix
caching off; the runs take turns ``--rounds`` times and each keeps its best. Prints each run's
output tok/s and its ratio to the run without LoRA. On a GPU, decode steps replay CUDA graphs,
the adapters' deltas within them; ``--eager`` turns graphs off for both engines.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.cli import parse_bytes  # noqa: E402
from services.engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from services.host_memory import restart_with_huge_page_heap  # noqa: E402
from services.models.random_lora import write_random_adapter  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "small-llama"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--kv-cache-memory", type=parse_bytes, default=None, help="each engine's (two run)"
    )
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (a GPU's default)")
    args = parser.parse_args()

    def engine(enable_lora: bool) -> LLM:
        return LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=args.input_len + args.output_len,
            max_num_seqs=args.num_prompts,
            enable_prefix_caching=False,
            enable_lora=enable_lora,
            max_loras=2,
            max_lora_rank=args.rank,
            device=args.device,
            kv_cache_memory=args.kv_cache_memory,
            cuda_graphs=False if args.eager else None,
        )

    plain, with_lora = engine(False), engine(True)
    config = with_lora.engine.model_config
    rng = random.Random(0)
    prompts = [
        [rng.randrange(16, config.vocab_size) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for seed in (1, 2):
            path = Path(tmp) / f"adapter-{seed}"
            write_random_adapter(path, config, rank=args.rank, alpha=2.0 * args.rank, std=0.02,
                                 seed=seed)  # fmt: skip
            adapters.append(LoRARequest(f"adapter-{seed}", seed, path))
        half: list[LoRARequest | None] = [adapters[i % 2] for i in range(args.num_prompts)]
        runs: dict[str, tuple[LLM, LoRARequest | list[LoRARequest | None] | None]] = {
            "no LoRA": (plain, None),
            "LoRA on, base requests": (with_lora, None),
            "one adapter": (with_lora, adapters[0]),
            "two adapters, half each": (with_lora, half),
        }
        for llm, lora in runs.values():  # warm-up: kernels, adapters loaded
            warm = lora[:2] if isinstance(lora, list) else lora
            llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False,
                         lora_request=warm)  # fmt: skip
        best = {name: float("inf") for name in runs}
        for _ in range(args.rounds):
            for name, (llm, lora) in runs.items():
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
                best[name] = min(best[name], time.perf_counter() - start)
    tokens = args.num_prompts * args.output_len
    dtype = with_lora.engine.dtype_choice.dtype
    static = with_lora.engine.runner.static_decode
    graphs = static is not None and static.use_graphs
    print(f"{args.model.name}, {dtype}, {args.device}, decode graphs {graphs}, "
          f"{args.num_prompts} prompts x {args.input_len} tokens, "
          f"{args.output_len} out, rank {args.rank}, best of {args.rounds}")  # fmt: skip
    for name, seconds in best.items():
        print(f"{name:26s} {seconds:7.2f} s  {tokens / seconds:8.1f} output tok/s  "
              f"{best['no LoRA'] / seconds:5.2f}x")  # fmt: skip


if __name__ == "__main__":
    restart_with_huge_page_heap()
    main()
