"""Decode attention over the paged KV cache: the torch path against the native CPU kernel.

    python benchmarks/attention_kernels.py [--dtype bfloat16] [--threads N] [--repeats 20]
        [--layers 1] [--block-size 16] [--contiguous-blocks] [--window N]

Times one layer's decode attention (``_decode`` of ``TorchPagedAttention`` and of
``NativePagedAttention``) on the small model's shapes: 12 query heads, 4 KV heads, head_dim 64,
block size 16 (``--block-size``). Each batch has ``num_seqs`` decodes whose contexts are
``context`` tokens long, in blocks scattered at random over a cache twice the batch's size
(``--contiguous-blocks``: each sequence's blocks in a row, one sequence after another). Prints
milliseconds per call (the best of several timed runs, as the machine may be shared) and the
speedup.

``--window N``: a sliding-window layer's decode (Gemma 3's), each sequence attending to its last
N tokens only; the native column's GB/s then counts the window's K/V.

NOTE: one layer's cache here may fit in the CPU's last-level cache, where a model's 12 layers
do not. ``--layers 12`` gives each of 12 layers its own cache and cycles the calls over them, as
a decode step does, so that the K/V come from memory; the native column's GB/s is the K/V bytes
it read per second.
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

from services.host_memory import restart_with_huge_page_heap  # noqa: E402
from services.models.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402
from services.models.native_attention import NativePagedAttention  # noqa: E402
from services.models.native_build import native_kernel_error  # noqa: E402

CASES = [(1, 256), (16, 512), (64, 320), (64, 1024)]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16


def make_batch(
    num_seqs: int,
    context: int,
    dtype: torch.dtype,
    seed: int = 0,
    block_size: int = BLOCK_SIZE,
    contiguous: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """query [num_seqs, heads, dim], kv_cache [2, blocks, block, kv_heads, dim], metadata."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_seq = -(-context // block_size)
    num_blocks = 2 * num_seqs * num_blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(
        dtype
    )
    if contiguous:
        block_ids = torch.arange(num_seqs * num_blocks_per_seq)
    else:
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
    layers: list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]],
    repeats: int,
    window: int | None = None,
) -> float:
    """Milliseconds per call; the calls cycle over ``layers`` (query, kv_cache, metadata)."""
    calls = [(query, kv_cache[0], kv_cache[1], metadata) for query, kv_cache, metadata in layers]

    def run() -> None:
        for query, key_cache, value_cache, metadata in calls:
            backend._decode(query, key_cache, value_cache, metadata, window)

    return best_ms(run, repeats) / len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--repeats", type=int, default=20, help="passes over the layers per timed run"
    )
    parser.add_argument(
        "--layers", type=int, default=1, help="separate caches the calls cycle over"
    )
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per block")
    parser.add_argument(
        "--contiguous-blocks",
        action="store_true",
        help="each sequence's blocks in a row instead of scattered at random",
    )
    parser.add_argument(
        "--window", type=int, default=None, help="attend to each sequence's last N tokens only"
    )
    args = parser.parse_args()
    if args.layers < 1 or args.repeats < 1 or args.block_size < 1:
        parser.error("--layers, --repeats and --block-size must be at least 1")
    if args.window is not None and args.window < 1:
        parser.error("--window must be at least 1")

    error = native_kernel_error()
    if error is not None:
        sys.exit(f"native kernel unavailable: {error}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    scale = HEAD_DIM**-0.5
    reference = TorchPagedAttention(args.block_size, scale)
    native = NativePagedAttention(args.block_size, scale)

    print(
        f"{args.dtype}, {torch.get_num_threads()} threads, {NUM_HEADS} q heads / "
        f"{NUM_KV_HEADS} kv heads x {HEAD_DIM}, block {args.block_size}"
        f"{' (contiguous)' if args.contiguous_blocks else ''}, {args.layers} layer(s)"
        f"{f', window {args.window}' if args.window else ''}; "
        "ms per layer call"
    )
    print(
        f"{'num_seqs':>8} {'context':>8} {'torch':>9} {'native':>9} {'speedup':>8} "
        f"{'native GB/s':>12}"
    )
    for num_seqs, context in CASES:
        layers = [
            make_batch(num_seqs, context, dtype, layer, args.block_size, args.contiguous_blocks)
            for layer in range(args.layers)
        ]
        torch_ms = time_decode(reference, layers, args.repeats, args.window)
        native_ms = time_decode(native, layers, args.repeats, args.window)
        read = min(context, args.window) if args.window else context
        kv_bytes = 2 * num_seqs * read * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
        print(
            f"{num_seqs:>8} {context:>8} {torch_ms:>9.3f} {native_ms:>9.3f} "
            f"{torch_ms / native_ms:>7.1f}x {kv_bytes / native_ms / 1e6:>12.1f}"
        )


if __name__ == "__main__":
    restart_with_huge_page_heap()  # as the nodes run: services/host_memory.py
    main()
