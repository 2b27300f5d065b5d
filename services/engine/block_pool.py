"""The physical KV blocks: reference counts, the free blocks and the prefix-cache index.

Life cycle of a block:

1. free, uncached      in the free runs (``free_runs.py``): maximal runs of consecutive free ids,
                       handed out so that a sequence's blocks lie in a row where they can.
2. in use              ``ref_count >= 1``: one reference per request whose block table holds it.
3. in use, cached      also indexed by the chained hash of its (full) tokens, so another request
                       with the same prefix can share it (``touch`` adds a reference).
4. free, cached        ``ref_count == 0`` but still indexed: its KV stays valid and a prefix hit
                       revives it. It waits in the cached free queue in LRU order, and is evicted
                       (its hash forgotten, the block moved to the free runs) only when the free
                       runs hold too few blocks for an allocation: an uncached free block is
                       always handed out before a cached one loses its contents.

Invariant: a block is free iff its ``ref_count`` is 0; a free block is in the cached free queue
iff it has a hash, else in the free runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from services.engine.free_runs import FreeRuns


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
        self._runs = FreeRuns(num_blocks)
        # Free cached blocks in eviction order: evicted from the front, freed ones appended at the
        # back. An OrderedDict gives O(1) removal from the middle when a prefix hit revives one.
        self._cached_free: OrderedDict[int, Block] = OrderedDict()
        self._cached: dict[bytes, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out, cached ones included."""
        return self._runs.num_blocks + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

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
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int, after: int | None = None) -> list[Block]:
        """``num_blocks`` blocks, one reference each. ``after``: the last block the caller's
        sequence holds; the free uncached blocks right after it are handed out first, so that
        the sequence grows in place (a cached block there is not evicted for it: measured on chat
        traffic, that cost prefix hits). The rest come from the free runs, in a row where one run
        holds them; cached blocks are evicted (least recently freed first) when the runs hold
        too few, and up to ``num_blocks`` more while no run is long enough (those least recently
        freed blocks are mostly a finished sequence's, in a row)."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} are free")
        block_ids = [] if after is None else self._runs.take_after(after, num_blocks)
        num_wanted = num_blocks - len(block_ids)
        if num_wanted:
            num_spare = num_wanted
            while self._cached_free and (
                self._runs.num_blocks < num_wanted
                or (self._runs.max_run_length < num_wanted and num_spare > 0)
            ):
                if self._runs.num_blocks >= num_wanted:
                    num_spare -= 1
                # The least recently freed cached block gives up its contents.
                _, evicted = self._cached_free.popitem(last=False)
                assert evicted.block_hash is not None, evicted
                del self._cached[evicted.block_hash]
                evicted.block_hash = None
                self._runs.add(evicted.block_id)
            block_ids.extend(self._runs.take(num_wanted))
        blocks = [self.blocks[block_id] for block_id in block_ids]
        for block in blocks:
            assert block.ref_count == 0 and block.block_hash is None, block
            block.ref_count = 1
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (a prefix hit), reviving free cached ones."""
        for block in blocks:
            if block.ref_count == 0:
                assert block.block_hash is not None, f"touching free uncached {block.block_id}"
                del self._cached_free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; for cached ones, the order given is the order of
        later eviction."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._runs.add(block.block_id)
                else:
                    self._cached_free[block.block_id] = block

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
        for block_id in self._cached_free:
            self._runs.add(block_id)
        self._cached_free.clear()
