"""Which prefill node last saw each prompt prefix: the hint behind prefix-affine routing.

A prompt is cut into blocks of ``block_size`` tokens and each full block gets a chained hash
(its tokens and its parent's hash), so equal hashes mean equal prefixes, as in the nodes' prefix
cache. ``lookup`` walks a prompt's chain from its longest prefix down and returns, per node, the
longest prefix that node was last sent; ``record`` remembers the chain for the node chosen. The
index is an LRU bounded by ``max_entries`` — soft state that costs nothing when it is wrong: a
miss only means one prefix-cache miss on a prefill node.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# Only the first blocks of a long prompt are indexed: affinity is decided by shared heads
# (system prompts, few-shot examples), and hashing 100k-token prompts per request would cost.
MAX_INDEXED_BLOCKS = 256

Namespace = tuple[str | None, str | None]
"""(cache salt, LoRA adapter name) of a prompt: prefixes are shared only within one, as in the
nodes' prefix caches (``kv_cache_manager.root_hash``)."""
BASE: Namespace = (None, None)
"""Unsalted prompts of the base model."""


class PrefixAffinity:
    def __init__(self, block_size: int, max_entries: int = 100_000) -> None:
        if block_size < 1 or max_entries < 1:
            raise ValueError("block_size and max_entries must be >= 1")
        self.block_size = block_size
        self.max_entries = max_entries
        self._owner: OrderedDict[int, str] = OrderedDict()  # block-chain hash -> node address

    def block_hashes(self, prompt: Sequence[int], namespace: Namespace = BASE) -> list[int]:
        """The prompt's chain; one of another ``namespace`` (a cache salt, a LoRA adapter)
        starts from it, as the nodes' chains do, so it matches only prompts of the same."""
        num_blocks = min(len(prompt) // self.block_size, MAX_INDEXED_BLOCKS)
        hashes: list[int] = []
        parent = 0 if namespace == BASE else hash(namespace)
        for i in range(num_blocks):
            # Python's hash of a tuple of ints is deterministic (no per-process salt).
            parent = hash((parent, tuple(prompt[i * self.block_size : (i + 1) * self.block_size])))
            hashes.append(parent)
        return hashes

    def matched_tokens(self, prompt: Sequence[int], namespace: Namespace = BASE) -> dict[str, int]:
        """Per node address: how many leading prompt tokens it was last sent (0 if none)."""
        matches: dict[str, int] = {}
        for depth, block_hash in enumerate(self.block_hashes(prompt, namespace), start=1):
            owner = self._owner.get(block_hash)
            if owner is not None:
                matches[owner] = depth * self.block_size
        return matches

    def record(self, prompt: Sequence[int], address: str, namespace: Namespace = BASE) -> None:
        for block_hash in self.block_hashes(prompt, namespace):
            self._owner[block_hash] = address
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget(self, address: str) -> None:
        """Drop a node's entries (it restarted, so its cache is empty)."""
        for block_hash in [h for h, owner in self._owner.items() if owner == address]:
            del self._owner[block_hash]

    def __len__(self) -> int:
        return len(self._owner)
