"""The receiver's view of the transfers writing into its regions, and fencing.

Per transfer id: (absent) → IN_PROGRESS (first message seen) → DONE (every byte landed), or →
FAILED | CANCELLED | TIMED_OUT (the writer aborted, failed or the receiver fenced it).

Fencing (design §3): `fence(id)` forbids every later write of that transfer, then waits until no
write is under way; after it returns True no byte of the transfer can land any more, so the
blocks may be freed and reused. A transfer fenced before it began is refused when it arrives.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from kv_transfer.transfer_status import TransferStatus


@dataclass
class InboundTransfer:
    status: TransferStatus = TransferStatus.IN_PROGRESS
    bytes_received: int = 0
    error: str | None = None
    is_fenced: bool = False
    # Copies into the destination regions under way right now.
    num_active_writes: int = 0


# Forgotten transfer ids stay refused (a late write must never land in reused blocks); this many
# of the newest are remembered.
MAX_TOMBSTONES = 65536


class InboundTransfers:
    def __init__(self) -> None:
        self._transfers: dict[str, InboundTransfer] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._cond = threading.Condition()

    def begin(self, transfer_id: str) -> str | None:
        """Starts tracking a transfer; returns why it is refused, or None."""
        with self._cond:
            known = self._transfers.get(transfer_id)
            if transfer_id in self._tombstones:
                return f"transfer {transfer_id!r} was already used and forgotten (use a fresh id)"
            if known is not None:
                if known.is_fenced:
                    return f"transfer {transfer_id!r} was fenced by the receiver"
                return f"transfer id {transfer_id!r} was already used (retry with a fresh id)"
            self._transfers[transfer_id] = InboundTransfer()
            self._cond.notify_all()
            return None

    def begin_write(self, transfer_id: str) -> bool:
        """Asks to copy into the destination; False means drop the bytes (fenced or ended)."""
        with self._cond:
            t = self._transfers.get(transfer_id)
            if t is None or t.is_fenced or t.status.is_terminal:
                return False
            t.num_active_writes += 1
            return True

    def end_write(self, transfer_id: str, num_bytes: int) -> None:
        with self._cond:
            t = self._transfers[transfer_id]
            t.num_active_writes -= 1
            t.bytes_received += num_bytes
            assert t.num_active_writes >= 0
            self._cond.notify_all()

    def finish(self, transfer_id: str, status: TransferStatus, error: str | None = None) -> None:
        assert status.is_terminal, status
        with self._cond:
            t = self._transfers.get(transfer_id)
            if t is None or t.status.is_terminal:
                return
            t.status, t.error = status, error
            self._cond.notify_all()

    def status(self, transfer_id: str) -> TransferStatus | None:
        with self._cond:
            t = self._transfers.get(transfer_id)
            return None if t is None else t.status

    def error(self, transfer_id: str) -> str | None:
        with self._cond:
            t = self._transfers.get(transfer_id)
            return None if t is None else t.error

    def wait(self, transfer_id: str, timeout: float | None) -> TransferStatus | None:
        """Waits until the transfer is terminal; None if it never began within the timeout."""
        with self._cond:
            self._cond.wait_for(lambda: self._is_terminal(transfer_id), timeout)
            t = self._transfers.get(transfer_id)
            return None if t is None else t.status

    def fence(self, transfer_id: str, timeout: float | None) -> bool:
        """Forbids further writes of the transfer and waits until none is under way."""
        with self._cond:
            t = self._transfers.setdefault(
                transfer_id, InboundTransfer(status=TransferStatus.CANCELLED)
            )
            t.is_fenced = True
            if not t.status.is_terminal:
                t.status, t.error = TransferStatus.CANCELLED, "fenced by the receiver"
            return self._cond.wait_for(lambda: t.num_active_writes == 0, timeout)

    def forget(self, transfer_id: str) -> bool:
        """Drops a finished, quiet transfer's record, keeping its id refused; False if the
        transfer is still running or writing (fence it first)."""
        with self._cond:
            t = self._transfers.get(transfer_id)
            if t is None:
                return True
            if t.num_active_writes or not t.status.is_terminal:
                return False
            del self._transfers[transfer_id]
            self._tombstones[transfer_id] = None
            if len(self._tombstones) > MAX_TOMBSTONES:
                self._tombstones.popitem(last=False)
            return True

    def _is_terminal(self, transfer_id: str) -> bool:
        t = self._transfers.get(transfer_id)
        return t is not None and t.status.is_terminal
