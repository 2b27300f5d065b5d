"""Pages in columnar form: how a KV cache hands over thousands of pages without a Python object
per page (a 2k-token prompt of the small model is 3,072 pages of 8 KiB)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kv_transfer.page_copy import PageCopy


@dataclass(frozen=True)
class PageTable:
    src_regions: list[str]
    dst_regions: list[str]
    # table: int64 [num_pages, 5] of (src region index, src offset, dst region index, dst offset,
    # length), indices into src_regions / dst_regions, offsets and lengths in bytes.
    table: np.ndarray

    def __post_init__(self) -> None:
        if self.table.ndim != 2 or self.table.shape[1] != 5:
            raise ValueError(f"a page table is [num_pages, 5], not {list(self.table.shape)}")

    def __len__(self) -> int:
        return len(self.table)

    @classmethod
    def from_pages(cls, pages: Sequence[PageCopy]) -> PageTable:
        src_regions = sorted({p.src_region for p in pages})
        dst_regions = sorted({p.dst_region for p in pages})
        src_index = {n: i for i, n in enumerate(src_regions)}
        dst_index = {n: i for i, n in enumerate(dst_regions)}
        flat = np.fromiter(
            (
                v
                for p in pages
                for v in (
                    src_index[p.src_region],
                    p.src_offset,
                    dst_index[p.dst_region],
                    p.dst_offset,
                    p.length,
                )
            ),
            dtype=np.int64,
            count=5 * len(pages),
        )
        return cls(src_regions, dst_regions, flat.reshape(-1, 5))

    @classmethod
    def from_blocks(
        cls,
        src_region: str,
        src_block_ids: Sequence[int] | np.ndarray,
        dst_region: str,
        dst_block_ids: Sequence[int] | np.ndarray,
        block_bytes: int,
    ) -> PageTable:
        """Block i of `src_region` → block j of `dst_region`, for paired block ids."""
        src = np.asarray(src_block_ids, dtype=np.int64)
        dst = np.asarray(dst_block_ids, dtype=np.int64)
        if src.shape != dst.shape or src.ndim != 1:
            raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
        # columns: int64 [5, num_pages], each written whole; the table is their transpose (a
        # view), which make_plan reads column by column without a copy.
        columns = np.empty((5, len(src)), dtype=np.int64)
        columns[0] = 0
        np.multiply(src, block_bytes, out=columns[1])
        columns[2] = 0
        np.multiply(dst, block_bytes, out=columns[3])
        columns[4] = block_bytes
        return cls([src_region], [dst_region], columns.T)

    @classmethod
    def concat(cls, tables: Sequence[PageTable]) -> PageTable:
        """One table of several (e.g. one per layer), in order."""
        src_regions = sorted({n for t in tables for n in t.src_regions})
        dst_regions = sorted({n for t in tables for n in t.dst_regions})
        parts = []
        for t in tables:
            part = t.table.copy()
            part[:, 0] = np.array([src_regions.index(n) for n in t.src_regions])[t.table[:, 0]]
            part[:, 2] = np.array([dst_regions.index(n) for n in t.dst_regions])[t.table[:, 2]]
            parts.append(part)
        return cls(src_regions, dst_regions, np.concatenate(parts))
