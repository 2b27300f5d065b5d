"""A mixture-of-experts layer's experts on a CPU: one grouped GEMM per product against a loop
over the experts hit (``SparseMoe``, ``services/models/llama.py``).

    python benchmarks/moe_experts.py [--experts 128] [--top-k 8] [--hidden 2048]
        [--expert-size 768] [--tokens 1,8,64] [--dtype float32] [--repeats 20]

Random router and expert weights (the defaults: Qwen3-30B-A3B's layer shape), ``--tokens``
rows at a time (a decode step's batch); prints milliseconds per layer call of each path (both
forced, whatever ``llama.GROUPED_MIN_TOKENS`` would choose), the best of three timed runs of
``--repeats`` calls, and how many experts the rows hit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.models import llama  # noqa: E402
from services.models.config import ModelConfig  # noqa: E402
from services.models.layer_ops import LayerOps  # noqa: E402
from services.models.llama import SparseMoe  # noqa: E402


def make_block(args: argparse.Namespace, dtype: torch.dtype) -> SparseMoe:
    config = ModelConfig.from_hf_dict(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": args.hidden,
            "intermediate_size": args.expert_size,
            "moe_intermediate_size": args.expert_size,
            "num_attention_heads": 16,
            "num_hidden_layers": 1,
            "vocab_size": 1000,
            "num_experts": args.experts,
            "num_experts_per_tok": args.top_k,
            "norm_topk_prob": True,
        }
    )
    block = SparseMoe(config, LayerOps())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return block.to(dtype)


def best_ms(block: SparseMoe, x: torch.Tensor, repeats: int) -> float:
    block(x)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            block(x)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-size", type=int, default=768)
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    # Both paths at every size: the block's own rule takes the loop below a few tokens.
    llama.GROUPED_MIN_TOKENS = 1
    block = make_block(args, dtype)
    print(
        f"{args.experts} experts, top {args.top_k}, hidden {args.hidden}, expert size "
        f"{args.expert_size}, {args.dtype}, {torch.get_num_threads()} threads; ms a layer call"
    )
    print(f"{'tokens':>6} {'experts hit':>11} {'grouped':>9} {'loop':>9} {'speedup':>8}")
    for num_tokens in (int(n) for n in args.tokens.split(",")):
        x = torch.randn(num_tokens, args.hidden, generator=torch.Generator().manual_seed(1))
        x = x.to(dtype)
        logits = torch.nn.functional.linear(x, block.router_weight)
        hit = int(torch.topk(logits, args.top_k, dim=-1).indices.unique().numel())
        block.grouped = True
        grouped = best_ms(block, x, args.repeats)
        block.grouped = False
        loop = best_ms(block, x, args.repeats)
        print(f"{num_tokens:>6} {hit:>11} {grouped:>9.2f} {loop:>9.2f} {loop / grouped:>7.2f}x")


if __name__ == "__main__":
    main()
