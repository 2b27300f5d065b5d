"""Bounds on concurrent and queued requests, shared by the HTTP and gRPC front ends.

Life cycle of one request here: ``admit()`` → QUEUED (waiting for one of ``max_concurrent``
slots; refused at once with RESOURCE_EXHAUSTED when ``max_queued`` are already waiting) →
RUNNING (holds a slot) → released when the ``async with`` block exits, however it exits. A
client that goes away while queued leaves the queue (its task is cancelled) without a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from gateway.errors import ErrorKind, GatewayError

TOKENIZER_SLOTS = 4
"""``/tokenize`` and ``/detokenize`` calls that tokenize at once (each in a thread of the event
loop's default executor, which the generation routes' tokenizing shares): a flood of them queues
here, bounded, instead of in that executor."""


class Admission:
    def __init__(self, max_concurrent: int, max_queued: int) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_concurrent)
        self.num_running = 0
        self.num_queued = 0

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one slot for the block; raises ``GatewayError`` when the queue is full."""
        if self._slots.locked() and self.num_queued >= self.max_queued:
            raise GatewayError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"server is at capacity: {self.num_running} requests running and "
                f"{self.num_queued} queued (max_queued_requests={self.max_queued}); retry later",
            )
        self.num_queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.num_queued -= 1
        self.num_running += 1
        try:
            yield
        finally:
            self.num_running -= 1
            self._slots.release()
