"""Where the block pool puts a sequence's KV blocks, and what that does to decode attention.

    python benchmarks/block_placement.py [--num-blocks 3000] [--max-num-seqs 48]
        [--steps 3000] [--num-conversations 1500] [--layers 12] [--seed 0] [--skip-kernel]

1. Placement (pure Python, deterministic): multi-turn chat traffic through the engine's own
   ``Scheduler`` and ``KVCacheManager``, no model: 8 system prompts of 160 tokens,
   ``--num-conversations`` conversations of 1-4 turns starting over the ``--steps`` steps, each
   turn's prompt the conversation so far plus 20-100 new tokens, 20-150 output tokens, the next
   turn 50-600 steps after the last; block size 16. Prints the prefix-cache hit rate and the
   share of the running sequences' consecutive table entries that are consecutive block ids
   (1.0: every sequence in a row), sampled every 50 steps.
2. The kernel (``--skip-kernel`` leaves it out): the running sequences at the last step, their
   block tables as the pool placed them, and the same tables with every block id sent through
   one random permutation of the pool (what a free queue in LRU order leaves after a while of
   serving), and each sequence's blocks in a row, the sequences in a random order spread over
   the pool (a shared prefix's blocks copied into each: more distinct bytes than the real
   tables, which share them). Native decode
   attention over each, the small model's shapes (12 query heads, 4 KV heads, head_dim 64,
   bf16), ``--layers`` caches of the pool's size cycled as a decode step does; ms per layer
   call, best of 7, and the K/V bytes it read per second.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.attention_kernels import best_ms  # noqa: E402
from services.engine.config import SchedulerConfig  # noqa: E402
from services.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from services.engine.request import Request  # noqa: E402
from services.engine.scheduler import SampledToken, Scheduler  # noqa: E402
from services.host_memory import restart_with_huge_page_heap  # noqa: E402
from services.models.attention import AttentionMetadata  # noqa: E402
from services.models.native_attention import NativePagedAttention  # noqa: E402
from services.models.native_build import native_kernel_error  # noqa: E402
from services.types import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 4, 64
SYSTEM_PROMPT_TOKENS = 160


def adjacency(tables: list[list[int]]) -> tuple[int, int]:
    """(consecutive pairs of table entries that are consecutive ids, all pairs)."""
    pairs = [(a, b) for table in tables for a, b in zip(table, table[1:], strict=False)]
    return sum(b == a + 1 for a, b in pairs), len(pairs)


def simulate_chat(
    args: argparse.Namespace,
) -> tuple[float, float, list[list[int]], list[int]]:
    """(hit rate, adjacency, the running sequences' block tables and context lengths)."""
    rng = random.Random(args.seed)
    kv = KVCacheManager(args.num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048),
        kv,
        max_model_len=8192,
        eos_token_ids=frozenset({0}),
    )
    next_token = 1_000_000

    def fresh(num_tokens: int) -> list[int]:
        nonlocal next_token
        next_token += num_tokens
        return list(range(next_token - num_tokens, next_token))

    systems = [fresh(SYSTEM_PROMPT_TOKENS) for _ in range(8)]
    conversations = [
        {
            "prompt": rng.choice(systems) + fresh(rng.randrange(20, 100)),
            "turns": rng.randrange(1, 5),
            "ready": rng.randrange(0, args.steps),
        }
        for _ in range(args.num_conversations)
    ]
    live: dict[int, Request] = {}
    num_adjacent = num_pairs = 0
    for step in range(args.steps):
        for index, conversation in enumerate(conversations):
            if len(live) >= args.max_num_seqs + 8:
                break
            if conversation["turns"] and conversation["ready"] <= step and index not in live:
                params = SamplingParams(max_tokens=rng.randrange(20, 150), ignore_eos=True)
                request = Request(
                    f"c{index}-{conversation['turns']}", conversation["prompt"], params
                )
                scheduler.add_request(request)
                live[index] = request
        output = scheduler.schedule()
        sampled = {
            chunk.request.request_id: [SampledToken(fresh(1)[0])]
            for chunk in output.chunks
            if chunk.needs_sample
        }
        scheduler.update_from_output(output, sampled)
        if step % 50 == 0:
            adjacent, pairs = adjacency([kv.block_ids(r.request_id) for r in live.values()])
            num_adjacent += adjacent
            num_pairs += pairs
        for index, request in list(live.items()):
            if request.status.is_finished:
                conversation = conversations[index]
                conversation["prompt"] = list(request.token_ids) + fresh(rng.randrange(20, 100))
                conversation["turns"] -= 1
                conversation["ready"] = step + rng.randrange(50, 600)
                del live[index]
    running = [r for r in live.values() if r.num_computed_tokens > 0]  # finished left live
    tables = [kv.block_ids(r.request_id) for r in running]
    lens = [r.num_computed_tokens for r in running]
    return kv.prefix_cache_stats.hit_rate, num_adjacent / max(num_pairs, 1), tables, lens


def time_tables(
    tables: list[list[int]], lens: list[int], num_blocks: int, num_layers: int
) -> tuple[float, float]:
    """(ms per layer call, GB/s of K/V) of native decode attention over these tables."""
    gen = torch.Generator().manual_seed(0)
    width = max(len(table) for table in tables)
    block_tables = torch.tensor([table + [0] * (width - len(table)) for table in tables])
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        num_decodes=len(tables),
        decode_block_tables=block_tables,
        decode_seq_lens=seq_lens,
        prefills=[],
    )
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(num_layers)]
    query = torch.randn(len(tables), NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    native = NativePagedAttention(BLOCK_SIZE, HEAD_DIM**-0.5)

    def run() -> None:
        for cache in caches:
            native._decode(query, cache[0], cache[1], metadata)

    ms = best_ms(run, repeats=5) / num_layers
    kv_bytes = 2 * sum(lens) * NUM_KV_HEADS * HEAD_DIM * 2
    return ms, kv_bytes / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=3000)
    parser.add_argument("--max-num-seqs", type=int, default=48)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--num-conversations", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-kernel", action="store_true")
    args = parser.parse_args()

    hit_rate, adjacent, tables, lens = simulate_chat(args)
    print(
        f"chat traffic, {args.num_blocks} blocks of {BLOCK_SIZE}, {args.steps} steps: "
        f"prefix-cache hit rate {hit_rate:.3f}, consecutive table entries {adjacent:.2f}"
    )
    if args.skip_kernel or not tables:
        return
    error = native_kernel_error()
    if error is not None:
        sys.exit(f"native kernel unavailable: {error}")
    permutation = torch.randperm(args.num_blocks, generator=torch.Generator().manual_seed(1))
    scattered = [[int(permutation[i]) for i in table] for table in tables]
    # Each sequence's blocks in a row (shared prefix blocks copied), the sequences in a random
    # order with the pool's spare blocks spread between them; a pool that the copies outgrow
    # grows for this layout (a table may be longer than an even share of the pool).
    order = torch.randperm(len(tables), generator=torch.Generator().manual_seed(2)).tolist()
    gap = max(0, args.num_blocks - sum(len(table) for table in tables)) // len(tables)
    in_a_row: list[list[int]] = [[] for _ in tables]
    next_id = 0
    for index in order:
        in_a_row[index] = list(range(next_id, next_id + len(tables[index])))
        next_id += len(tables[index]) + gap
    row_pool = max(args.num_blocks, next_id)
    print(
        f"decode attention over the last step's {len(tables)} sequences (mean context "
        f"{sum(lens) / len(lens):.0f} tokens), {args.layers} layers, ms per layer call:"
    )
    for name, placed, pool in (
        ("as placed", tables, args.num_blocks),
        ("scattered", scattered, args.num_blocks),
        ("in a row", in_a_row, row_pool),
    ) * 2:
        ms, rate = time_tables(placed, lens, pool, args.layers)
        print(f"  {name:<10} {ms:7.3f} ms  {rate:6.1f} GB/s")


if __name__ == "__main__":
    restart_with_huge_page_heap()  # as the nodes run: services/host_memory.py
    main()
