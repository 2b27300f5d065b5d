"""The explicit status of one KV transfer, as the writer and the receiver each see it."""

from __future__ import annotations

import enum


class TransferStatus(enum.Enum):
    """PENDING → IN_PROGRESS → DONE, or → FAILED | CANCELLED | TIMED_OUT.

    A terminal status never changes again. On the receiver, DONE means every byte landed in the
    destination regions; FAILED / CANCELLED / TIMED_OUT say nothing about which bytes landed, so
    the receiver must `fence()` the transfer before it reuses the blocks.
    """

    PENDING = "pending"
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def is_terminal(self) -> bool:
        return self not in (TransferStatus.PENDING, TransferStatus.IN_PROGRESS)
