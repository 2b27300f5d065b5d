"""The writer's view of one transfer: an explicit status to poll or await, never a set of flags.

Life cycle: PENDING (planned) → IN_PROGRESS (bytes moving) → DONE (the receiver confirmed every
byte landed) | FAILED (error, closed peer) | CANCELLED (`cancel()`) | TIMED_OUT (deadline passed).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from kv_transfer.transfer_status import TransferStatus


class TransferHandle:
    def __init__(
        self,
        transfer_id: str,
        num_bytes: int,
        deadline: float,
        on_cancel: Callable[[TransferHandle], None] | None = None,
    ) -> None:
        self.transfer_id = transfer_id
        # Bytes the transfer moves in all.
        self.num_bytes = num_bytes
        # time.monotonic() by which it must be DONE, or it ends TIMED_OUT.
        self.deadline = deadline
        # time.monotonic() when write() made the handle, when the transfer went IN_PROGRESS
        # (its bytes began to move; None: not yet, or it ended before) and when it ended.
        self.started_at = time.monotonic()
        self.in_progress_at: float | None = None
        self.finished_at: float | None = None
        self._status = TransferStatus.PENDING
        self._error: str | None = None
        self._bytes_moved = 0
        self._on_cancel = on_cancel
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[TransferStatus]]] = []

    @property
    def status(self) -> TransferStatus:
        return self._status

    @property
    def error(self) -> str | None:
        """Why the transfer ended other than DONE (None while running or when DONE)."""
        return self._error

    @property
    def bytes_moved(self) -> int:
        """Bytes known to have left the writer (all of them once DONE)."""
        return self._bytes_moved

    @property
    def seconds(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def wait(self, timeout: float | None = None) -> TransferStatus:
        """Blocks until the status is terminal or `timeout` seconds pass; returns the status."""
        with self._cond:
            self._cond.wait_for(lambda: self._status.is_terminal, timeout)
            return self._status

    async def wait_async(self, timeout: float | None = None) -> TransferStatus:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[TransferStatus] = loop.create_future()
        with self._cond:
            if self._status.is_terminal:
                return self._status
            self._waiters.append((loop, future))
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            return self._status

    def cancel(self) -> bool:
        """Stops the transfer; True if this call ended it. The receiver learns of it (abort)."""
        if not self.finish(TransferStatus.CANCELLED, "cancelled by the writer"):
            return False
        if self._on_cancel is not None:
            self._on_cancel(self)
        return True

    # Transport side.

    def start(self) -> None:
        with self._cond:
            if self._status is TransferStatus.PENDING:
                self._status = TransferStatus.IN_PROGRESS
                self.in_progress_at = time.monotonic()

    def add_bytes(self, num_bytes: int) -> None:
        with self._cond:
            if not self._status.is_terminal:
                self._bytes_moved = min(self.num_bytes, self._bytes_moved + num_bytes)

    def finish(self, status: TransferStatus, error: str | None = None) -> bool:
        """Sets a terminal status; False (and no change) if one was already set."""
        assert status.is_terminal, status
        with self._cond:
            if self._status.is_terminal:
                return False
            self._status = status
            self._error = error
            if status is TransferStatus.DONE:
                self._bytes_moved = self.num_bytes
            self.finished_at = time.monotonic()
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future, status)
        return True

    def __repr__(self) -> str:
        return (
            f"TransferHandle({self.transfer_id!r}, {self._status.name}, "
            f"{self._bytes_moved}/{self.num_bytes} B, error={self._error!r})"
        )


def _resolve(future: asyncio.Future[TransferStatus], status: TransferStatus) -> None:
    if not future.done():
        future.set_result(status)
