"""Decode attention over the paged KV cache: the torch path against the native CPU kernel.

    python benchmarks/attention_kernels.py [--dtype bfloat16] [--threads N] [--repeats 20]

Times one layer's decode attention (``_decode`` of ``TorchPagedAttention`` and of
``NativePagedAttention``) on the small model's shapes: 12 query heads, 4 KV heads, head_dim 64,
block size 16. Each batch has ``num_seqs`` decodes whose contexts are ``context`` tokens long,
in blocks scattered at random over a cache twice the batch's size. Prints milliseconds per call
(the best of several timed runs, as the machine may be shared) and the speedup.

NOTE: one layer's cache here may fit in the CPU's last-level cache, where a model's 12 layers
do not; the 64 x 1024 case (64 MiB of K/V in bf16) shows the memory-bound regime.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.models.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402
from services.models.native_attention import NativePagedAttention  # noqa: E402
from services.models.native_build import native_kernel_error  # noqa: E402

CASES = [(1, 256), (16, 512), (64, 320), (64, 1024)]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16


def make_batch(
    num_seqs: int, context: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """query [num_seqs, heads, dim], kv_cache [2, blocks, block, kv_heads, dim], metadata."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = 2 * num_seqs * num_blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(
        dtype
    )
    block_ids = torch.randperm(num_blocks, generator=gen)[: num_seqs * num_blocks_per_seq]
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        num_decodes=num_seqs,
        decode_block_tables=block_ids.view(num_seqs, num_blocks_per_seq),
        decode_seq_lens=torch.full((num_seqs,), context, dtype=torch.int64),
        prefills=[],
    )
    return query, kv_cache, metadata


def best_ms(fn: Callable[[], object], repeats: int, trials: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def time_decode(
    backend: TorchPagedAttention,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    repeats: int,
) -> float:
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    return best_ms(lambda: backend._decode(query, key_cache, value_cache, metadata), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=20, help="calls per timed run")
    args = parser.parse_args()

    error = native_kernel_error()
    if error is not None:
        sys.exit(f"native kernel unavailable: {error}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    scale = HEAD_DIM**-0.5
    reference = TorchPagedAttention(BLOCK_SIZE, scale)
    native = NativePagedAttention(BLOCK_SIZE, scale)

    print(
        f"{args.dtype}, {torch.get_num_threads()} threads, {NUM_HEADS} q heads / "
        f"{NUM_KV_HEADS} kv heads x {HEAD_DIM}, block {BLOCK_SIZE}; ms per layer call"
    )
    print(f"{'num_seqs':>8} {'context':>8} {'torch':>9} {'native':>9} {'speedup':>8}")
    for num_seqs, context in CASES:
        query, kv_cache, metadata = make_batch(num_seqs, context, dtype)
        torch_ms = time_decode(reference, query, kv_cache, metadata, args.repeats)
        native_ms = time_decode(native, query, kv_cache, metadata, args.repeats)
        print(
            f"{num_seqs:>8} {context:>8} {torch_ms:>9.3f} {native_ms:>9.3f} "
            f"{torch_ms / native_ms:>7.1f}x"
        )


if __name__ == "__main__":
    main()
