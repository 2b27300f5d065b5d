"""One page of a transfer: a byte range of a local region copied into a byte range of a peer's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageCopy:
    # Name of the writer's registered region, and the byte offset of the page in it.
    src_region: str
    src_offset: int
    # Name of the receiver's registered region (as published in its PeerAddress), byte offset.
    dst_region: str
    dst_offset: int
    # Bytes in the page.
    length: int
