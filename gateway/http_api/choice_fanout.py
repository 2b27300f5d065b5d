"""The concurrent choices of one HTTP request (prompts × n): each generation pumped by its own
task into one queue, so that events of one choice stay in order while choices interleave.

Life cycle: ``async with ChoiceFanout(...)`` starts every generation at once → ``first_events()``
waits for each choice's first event (the first ``GatewayError`` among them is raised: it decides
the response's status) → ``next()`` until every choice has its ``TextFinished`` → leaving the
block, however it is left, cancels the pumps, and closing each iterator cancels its node legs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Self

from gateway.errors import GatewayError
from gateway.frontend import Frontend
from gateway.generation import GenerationRequest
from gateway.pipeline import TextOptions, generate_text
from gateway.text.text_stream import TextDelta, TextFinished

logger = logging.getLogger(__name__)

ChoiceEvent = TextDelta | TextFinished


class ChoiceQueue:
    """What the response reads choices from: every choice's events on one queue, in order within
    a choice, from the tasks a subclass's ``_start`` makes on entering the block
    (``ChoiceFanout``'s one per choice; ``beam_search_fanout``'s one per prompt). Leaving the
    block cancels them."""

    def __init__(self, num_choices: int) -> None:
        self._num_choices = num_choices
        self._queue: asyncio.Queue[tuple[int, ChoiceEvent | Exception]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def _start(self) -> list[asyncio.Task[None]]:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        self._tasks = self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # Cancelling a task closes its iterators; the generator then cancels its node legs.
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def first_events(self) -> list[tuple[int, ChoiceEvent]]:
        """Events up to every choice's first one; the first error among them is raised."""
        waiting = set(range(self._num_choices))
        events: list[tuple[int, ChoiceEvent]] = []
        while waiting:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            events.append((index, item))
            waiting.discard(index)
        return events

    async def next(self) -> tuple[int, ChoiceEvent | Exception]:
        return await self._queue.get()


class ChoiceFanout(ChoiceQueue):
    """The generations of one HTTP request, in choice order: prompt 0's n choices, then 1's..."""

    def __init__(
        self,
        frontend: Frontend,
        requests: Sequence[GenerationRequest],
        options: TextOptions,
    ) -> None:
        super().__init__(len(requests))
        self._frontend = frontend
        self._requests = requests
        self._options = options

    def _start(self) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self._pump(index, request), name=request.request_id)
            for index, request in enumerate(self._requests)
        ]

    async def _pump(self, index: int, request: GenerationRequest) -> None:
        try:
            async with generate_text(self._frontend, request, self._options) as texts:
                is_finished = False
                async for event in texts:
                    self._queue.put_nowait((index, event))
                    is_finished = isinstance(event, TextFinished)
                if not is_finished:  # the consumer waits for a TextFinished: never a hang
                    raise RuntimeError("the text stream ended without a final event")
        except GatewayError as error:
            self._queue.put_nowait((index, error))
        except Exception as error:  # a bug: the request fails, the server goes on
            logger.exception("request %s failed", request.request_id)
            self._queue.put_nowait((index, error))
