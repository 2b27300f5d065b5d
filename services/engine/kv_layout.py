"""Where each block's keys and values sit in a node's KV cache, for peers that copy pages.

A node's cache is one memory region per layer, ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``: all key blocks, then all value blocks. A prefill node pushes a prompt's blocks into
the blocks a decode node reserved; the two caches agree on everything but ``num_blocks``, which
the fingerprint leaves out (it moves the value half, so copies are computed from both layouts).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_ITEM_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e5m2": 1}
LAYOUT_NAME = "per-layer [2, block, slot, kv_head, head_dim]"


@dataclass(frozen=True)
class KvLayout:
    model_id: str
    """Architecture and a hash of config.json: both nodes must run the same model."""
    dtype: str
    """The dtype the cache holds (``kv_cache_dtype``, resolved), which may differ from the
    compute dtype: two nodes exchange pages iff they agree on it."""
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    """This node's cache size; not part of the fingerprint."""

    def __post_init__(self) -> None:
        if self.dtype not in _ITEM_SIZE:
            raise ValueError(f"unknown KV dtype {self.dtype!r}")

    @property
    def fingerprint(self) -> str:
        """Equal on two nodes iff a page copied from one is valid in the other."""
        fields = (
            LAYOUT_NAME,
            self.model_id,
            self.dtype,
            self.block_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
        )
        return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys (or values) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * _ITEM_SIZE[self.dtype]

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_bytes

    def key_offset(self, block_id: int) -> int:
        return block_id * self.block_bytes

    def value_offset(self, block_id: int) -> int:
        return (self.num_blocks + block_id) * self.block_bytes


def layout_difference(a: KvLayout, b: KvLayout) -> str:
    """The fingerprinted fields on which two layouts disagree, e.g. ``dtype float32 vs
    bfloat16`` (a KV dtype mismatch is the likely one: set ``kv_cache_dtype`` alike)."""
    names = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
    parts = [
        f"{name} {getattr(a, name)} vs {getattr(b, name)}"
        for name in names
        if getattr(a, name) != getattr(b, name)
    ]
    return ", ".join(parts) or "layout version"


@dataclass(frozen=True)
class LayerCopy:
    """``length`` bytes from ``src_offset`` in the source's layer region to ``dst_offset`` in the
    destination's region of the same layer."""

    layer: int
    src_offset: int
    dst_offset: int
    length: int


def layer_copies(
    src: KvLayout, src_block_ids: Sequence[int], dst: KvLayout, dst_block_ids: Sequence[int]
) -> list[LayerCopy]:
    """The copies that move ``src_block_ids`` into ``dst_block_ids`` (pairwise), keys and values
    of every layer, with runs of consecutive blocks on both sides merged into one copy.

    One object per copy, for in-process copies and as the reference for `layer_copy_table`,
    which a push uses."""
    check_block_pairing(src, src_block_ids, dst, dst_block_ids)
    # runs: (first source block, first destination block, number of blocks)
    runs: list[list[int]] = []
    for s, d in zip(src_block_ids, dst_block_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    size = src.block_bytes
    copies = []
    for layer in range(src.num_layers):
        for s, d, n in runs:
            copies.append(LayerCopy(layer, src.key_offset(s), dst.key_offset(d), n * size))
            copies.append(LayerCopy(layer, src.value_offset(s), dst.value_offset(d), n * size))
    return copies


def layer_copy_table(
    src: KvLayout, src_block_ids: Sequence[int], dst: KvLayout, dst_block_ids: Sequence[int]
) -> np.ndarray:
    """`layer_copies` as one int64 [num_copies, 4] table of (layer, src offset, dst offset,
    length): the same copies in the same order, without a Python object per copy (a 2k-token
    push of the small model is 3,072 copies: 6.7 ms -> 70 us with the page table built, on the
    2-core CPU host)."""
    src_ids, dst_ids = check_block_pairing(src, src_block_ids, dst, dst_block_ids)
    # A run starts where either side does not follow on from the block before it.
    follows = np.zeros(len(src_ids), dtype=bool)
    follows[1:] = (np.diff(src_ids) == 1) & (np.diff(dst_ids) == 1)
    starts = np.flatnonzero(~follows)  # int64 [num_runs]
    run_src, run_dst = src_ids[starts], dst_ids[starts]
    size = src.block_bytes
    # One layer's copies, the same in every layer's region: int64 [num_runs, 2 (K, V), 3] of
    # (src offset, dst offset, length), offsets as key_offset / value_offset compute them.
    per_layer = np.empty((len(starts), 2, 3), dtype=np.int64)
    per_layer[:, 0, 0] = run_src * size
    per_layer[:, 1, 0] = (src.num_blocks + run_src) * size
    per_layer[:, 0, 1] = run_dst * size
    per_layer[:, 1, 1] = (dst.num_blocks + run_dst) * size
    per_layer[:, :, 2] = (np.diff(starts, append=len(src_ids)) * size)[:, None]
    # table: int64 [num_layers, 2 * num_runs, 4], layer by layer as layer_copies orders them.
    table = np.empty((src.num_layers, 2 * len(starts), 4), dtype=np.int64)
    table[:, :, 0] = np.arange(src.num_layers)[:, None]
    table[:, :, 1:] = per_layer.reshape(-1, 3)
    return table.reshape(-1, 4)


def check_block_pairing(
    src: KvLayout, src_block_ids: Sequence[int], dst: KvLayout, dst_block_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Both id lists as int64 arrays ([num_blocks] each), once the layouts match and the ids pair
    up, each inside its own cache; else ValueError."""
    if src.fingerprint != dst.fingerprint:
        difference = layout_difference(src, dst)
        raise ValueError(
            f"KV layouts differ: {src.fingerprint} vs {dst.fingerprint} ({difference})"
        )
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destinations"
        )
    arrays = []
    for name, layout, ids in (("source", src, src_block_ids), ("destination", dst, dst_block_ids)):
        array = np.asarray(ids, dtype=np.int64)
        bad = array[(array < 0) | (array >= layout.num_blocks)]
        if len(bad):
            raise ValueError(
                f"{name} block ids {bad[:4].tolist()} outside [0, {layout.num_blocks})"
            )
        arrays.append(array)
    return arrays[0], arrays[1]
