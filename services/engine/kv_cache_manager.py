"""Per-request block tables over a shared ``BlockPool``, with prefix caching.

Life cycle of a request's blocks:

1. ``get_computed_blocks``   before admission: the longest run of cached full blocks matching
                             the request's tokens (never all of them: the last token is always
                             recomputed to produce logits). ``record_prefix_lookup`` counts it
                             once the request is admitted with it.
2. ``can_allocate`` / ``allocate``
                             each step: reference the hit blocks (first time only) and append new
                             blocks so that every token computed this step has a slot, asked
                             for after the request's last block so that its table stays in a
                             row where the pool can (``try_allocate``: both at once for a
                             running request).
3. ``cache_full_blocks``     after the step: index the request's newly completed full blocks by
                             their chained hash, so that later requests can share them.
4. ``free``                  on finish, abort or preemption: drop the request's references, last
                             block first, so the tail of a sequence is evicted before its prefix.

A decode node's reservation (``Scheduler.reserve``) takes its hit at 1-2 at once; at its commit,
``share_cached_prefix`` swaps the leading blocks a side-by-side reservation committed first for
the cached ones, before 3.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from services.engine.block_pool import Block, BlockPool
from services.engine.request import Request

_ROOT_HASH = b"pdserve-kv-v1"


def root_hash(cache_salt: str | None, lora_name: str | None = None) -> bytes:
    """The parent of a prompt's first block: one for every unsalted request of the base model,
    and one per ``SamplingParams.cache_salt`` and ``lora_name``, so that salted chains never
    meet another salt's (or the unsalted) chain, and an adapter's KV (which its deltas change)
    is never served to a request of another adapter or of none."""
    if cache_salt is None and lora_name is None:
        return _ROOT_HASH
    digest = hashlib.sha256(_ROOT_HASH)
    for tag, part in ((b"salt", cache_salt), (b"lora", lora_name)):
        # Each part tagged and length-prefixed: no salt and adapter name pair spells another's.
        data = b"" if part is None else part.encode("utf-8")
        digest.update(b"\0%s\0%d:%s" % (tag, len(data) if part is not None else -1, data))
    return digest.digest()


def hash_block_tokens(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: equal hashes mean equal token prefixes.

    SHA-256 rather than Python's ``hash`` because a collision would silently serve another
    prompt's KV, and because the value must be the same in every process (prefix-aware routing).
    """
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


@dataclass(frozen=True)
class PrefixCacheStats:
    num_queried_tokens: int
    num_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[Block]] = {}
        # The same tables as block ids, kept beside them: every step hands each scheduled
        # request's ids on, and building them anew cost more than the rest of its scheduling.
        self._block_ids: dict[str, list[int]] = {}
        # Leading blocks of each request already indexed, so each step only hashes new ones.
        self._num_cached_blocks: dict[str, int] = {}
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_queried_tokens, self._num_hit_tokens)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._block_ids.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Cached blocks that hold a prefix of ``request.token_ids``, and the tokens they cover."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            # Cached positions get no logits: a prompt whose logprobs are asked for is computed.
            return [], 0
        # NOTE: a fully cached prompt still recomputes its last token to get logits.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_block_hashes(request, max_hit_blocks)
        hits: list[Block] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block] = ()
    ) -> bool:
        num_needed, num_revived = self._count_needed(request, num_new_tokens, computed_blocks)
        return self.pool.can_allocate(num_needed + num_revived)

    def allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block] = ()
    ) -> None:
        """Give ``request`` slots for ``num_new_tokens`` past its computed (or hit) tokens."""
        num_needed, _ = self._count_needed(request, num_new_tokens, computed_blocks)
        blocks = self._blocks.setdefault(request.request_id, [])
        ids = self._block_ids.setdefault(request.request_id, [])
        if computed_blocks:
            assert not blocks, f"prefix hit for {request.request_id}, which already holds blocks"
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            ids.extend(block.block_id for block in computed_blocks)
        new_blocks = self.pool.allocate(num_needed, after=ids[-1] if ids else None)
        blocks.extend(new_blocks)
        ids.extend(block.block_id for block in new_blocks)

    def try_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """``can_allocate`` then ``allocate`` for a request already holding its blocks (no prefix
        hit), counted once: False, holding nothing more, when the pool is short. Most decode
        steps need no block at all, and return at the first test."""
        blocks = self._blocks.get(request.request_id)
        num_held = len(blocks) if blocks is not None else 0
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - num_held
        if num_needed <= 0:
            return True
        if not self.pool.can_allocate(num_needed):
            return False
        ids = self._block_ids.setdefault(request.request_id, [])
        new_blocks = self.pool.allocate(num_needed, after=ids[-1] if ids else None)
        self._blocks.setdefault(request.request_id, []).extend(new_blocks)
        ids.extend(block.block_id for block in new_blocks)
        return True

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup; the scheduler calls it once per admission, not each time
        it asks ``get_computed_blocks`` for a request that then has to keep waiting."""
        self._num_queried_tokens += num_queried_tokens
        self._num_hit_tokens += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Index every full block whose tokens are all computed (called after each step)."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks[request.request_id]
        num_done = self._num_cached_blocks.get(request.request_id, 0)
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= num_done:
            return
        self._extend_block_hashes(request, num_full)
        for index in range(num_done, num_full):
            self.pool.cache_block(blocks[index], request.block_hashes[index])
        self._num_cached_blocks[request.request_id] = num_full

    def share_cached_prefix(self, request: Request) -> int:
        """Swap each leading full block of ``request`` whose tokens another block already holds
        in the prefix cache for that block, freeing its own copy; the number swapped.

        For a decode node's reservation at its commit (``Scheduler.commit``): reservations made
        side by side for one new prefix (a burst of chats sharing a system prompt) each had it
        pushed into blocks of their own, and the first commit indexed its copy; the later ones
        then hold the same tokens' KV twice for their whole lives. Safe only before the
        request's first step: its block table changes."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return 0
        blocks = self._blocks[request.request_id]
        ids = self._block_ids[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        self._extend_block_hashes(request, num_full)
        num_swapped = 0
        for index in range(num_full):
            cached = self.pool.get_cached_block(request.block_hashes[index])
            if cached is None:
                break  # a chain: no later block can be cached either
            own = blocks[index]
            if cached is own:
                continue
            self.pool.touch([cached])
            self.pool.free([own])
            blocks[index] = cached
            ids[index] = cached.block_id
            num_swapped += 1
        return num_swapped

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def _count_needed(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block]
    ) -> tuple[int, int]:
        """(new blocks to allocate, free cached blocks that a prefix hit takes out of the queue)."""
        num_held = len(self._blocks.get(request.request_id, ())) + len(computed_blocks)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = max(0, self.num_blocks_for(num_computed + num_new_tokens) - num_held)
        num_revived = sum(1 for block in computed_blocks if block.ref_count == 0)
        return num_needed, num_revived

    def _extend_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        hashes = request.block_hashes
        size = self.block_size
        params = request.params
        parent = hashes[-1] if hashes else root_hash(params.cache_salt, params.lora_name)
        for index in range(len(hashes), num_full_blocks):
            parent = hash_block_tokens(parent, request.token_ids[index * size : (index + 1) * size])
            hashes.append(parent)
