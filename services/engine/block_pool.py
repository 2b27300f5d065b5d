"""The physical KV blocks: reference counts, the free queue and the prefix-cache index.

Life cycle of a block:

1. free, uncached      in the free queue, no hash; handed out first come first served.
2. in use              ``ref_count >= 1``: one reference per request whose block table holds it.
3. in use, cached      also indexed by the chained hash of its (full) tokens, so another request
                       with the same prefix can share it (``touch`` adds a reference).
4. free, cached        ``ref_count == 0`` but still indexed: its KV stays valid and a prefix hit
                       revives it. It sits in the free queue in LRU order; when it reaches the
                       head and is handed out again, its hash is evicted first.

Invariant: a block is in the free queue iff its ``ref_count`` is 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # Free queue in eviction order: popped from the front, freed blocks appended at the back.
        # An OrderedDict gives O(1) removal from the middle when a prefix hit revives a block.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out, cached ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[Block]:
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} are free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            assert block.ref_count == 0, block
            if block.block_hash is not None:
                # The least recently freed cached block is the one reused: forget its contents.
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (a prefix hit), reviving free cached ones."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; the order given is the order of later eviction."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        """Index a full, computed block under its chained hash.

        If another block already holds the same tokens (two requests computed the same prefix
        side by side), the first stays indexed and this one remains private.
        """
        assert block.ref_count > 0, f"caching free block {block.block_id}"
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change); blocks in use are untouched."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
