"""Does a decode step slow down when the KV cache lives in shared memory (the shm transport)?

    python benchmarks/kv_cache_memory.py [--cache-mib 1024] [--steps 40] [--threads 1]

With ``--kv-transport shm`` (what ``auto`` picks on CPU) the decode node's KV cache is moved
into memfd shared memory (``services/kv_regions.py``), which gets transparent huge pages only
where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows; private memory gets them
through ``madvise`` (``services/host_memory.advise_huge_pages``, as the model runner does). This
times the part of a decode step that reads the cache: the native paged decode attention of
every layer of the `small` model (12 layers, 4 KV heads x 64, block 16, bf16) for a batch of
decodes whose blocks are scattered over the whole cache, on a private cache and on a shared one
of the same size, steps alternating between the two. It prints how much of each cache the
kernel backed with huge pages (from /proc/self/smaps), milliseconds per step, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kv_transfer import shared_memory  # noqa: E402
from services.host_memory import advise_huge_pages  # noqa: E402
from services.models.attention import AttentionMetadata  # noqa: E402
from services.models.native_attention import NativePagedAttention  # noqa: E402
from services.models.native_build import native_kernel_error  # noqa: E402

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 12, 4, 64, 16
# Bytes of one block of one layer, K and V: [2, block, kv_heads, dim] bf16.
BLOCK_BYTES = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def private_cache(num_bytes: int) -> torch.Tensor:
    """Private memory as the model runner allocates it: huge pages advised before first touch."""
    cache = torch.empty(num_bytes, dtype=torch.uint8)
    advise_huge_pages(cache.data_ptr(), cache.nbytes)
    cache.zero_()
    return cache


def shared_cache(num_bytes: int) -> torch.Tensor:
    """Shared memory as the shm transport allocates it (memfd, MADV_HUGEPAGE asked for)."""
    cache = torch.frombuffer(shared_memory.allocate(num_bytes), dtype=torch.uint8)
    cache.zero_()
    return cache


def huge_bytes(cache: torch.Tensor) -> int:
    """Bytes of `cache`'s mapping backed by huge pages (AnonHugePages / ShmemPmdMapped)."""
    start, end = cache.data_ptr(), cache.data_ptr() + cache.nbytes
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low < end and start < high
            elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                total += int(line.split()[1]) * 1024
    return total


def layer_views(cache: torch.Tensor, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key_cache, value_cache), each [num_blocks, block, kv_heads, dim] bf16."""
    layers = cache[: NUM_LAYERS * num_blocks * BLOCK_BYTES].view(torch.bfloat16)
    layers = layers.view(NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [(layers[i, 0], layers[i, 1]) for i in range(NUM_LAYERS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-mib", type=int, default=1024, help="size of each cache")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=320, help="tokens per decode (256 + 64)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per cache")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the node's: 1)")
    args = parser.parse_args()
    error = native_kernel_error()
    if error is not None:
        sys.exit(f"native kernel unavailable: {error}")
    torch.set_num_threads(args.threads)
    num_bytes = args.cache_mib << 20
    num_blocks = num_bytes // (NUM_LAYERS * BLOCK_BYTES)
    blocks_per_seq = -(-args.context // BLOCK_SIZE)
    if args.num_seqs * blocks_per_seq > num_blocks:
        sys.exit(f"{args.num_seqs} x {args.context} tokens do not fit {args.cache_mib} MiB")

    caches = {"private": private_cache(num_bytes), "shared": shared_cache(num_bytes)}
    layers = {name: layer_views(cache, num_blocks) for name, cache in caches.items()}
    gen = torch.Generator().manual_seed(0)
    for key, value in layers["private"]:
        key.normal_(generator=gen)
        value.normal_(generator=gen)
    caches["shared"].copy_(caches["private"])  # the same K/V bytes in both
    rng = np.random.default_rng(1)
    block_ids = rng.choice(num_blocks, args.num_seqs * blocks_per_seq, replace=False)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        num_decodes=args.num_seqs,
        decode_block_tables=torch.from_numpy(block_ids).view(args.num_seqs, blocks_per_seq),
        decode_seq_lens=torch.full((args.num_seqs,), args.context, dtype=torch.int64),
        prefills=[],
    )
    query = torch.randn(args.num_seqs, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    attention = NativePagedAttention(BLOCK_SIZE, HEAD_DIM**-0.5)

    def step(name: str) -> float:
        start = time.perf_counter()
        for key, value in layers[name]:
            attention._decode(query, key, value, metadata)
        return time.perf_counter() - start

    outputs = {n: attention._decode(query, *layers[n][0], metadata) for n in caches}
    assert torch.equal(outputs["private"], outputs["shared"]), "the two caches must agree"
    shmem = SHMEM_ENABLED.read_text().strip() if SHMEM_ENABLED.exists() else "n/a"
    print(
        f"{NUM_LAYERS} layers, {args.num_seqs} decodes x {args.context} tokens, blocks scattered "
        f"over {args.cache_mib} MiB; {torch.get_num_threads()} torch thread(s); "
        f"shmem_enabled: {shmem}"
    )
    for name, cache in caches.items():
        print(f"{name:>8}: {huge_bytes(cache) >> 20} of {cache.nbytes >> 20} MiB in huge pages")
    times: dict[str, list[float]] = {name: [] for name in caches}
    for name in caches:
        step(name)  # warm-up
    for _ in range(args.steps):
        for name in caches:
            times[name].append(step(name))
    pairs = [s / p for s, p in zip(times["shared"], times["private"], strict=True)]
    for name, seconds in times.items():
        print(
            f"{name:>8}: median {statistics.median(seconds) * 1e3:7.2f} ms, "
            f"min {min(seconds) * 1e3:7.2f} ms per step (attention of {NUM_LAYERS} layers)"
        )
    print(f"shared / private, median of pairs: {statistics.median(pairs):.3f}")


if __name__ == "__main__":
    main()
