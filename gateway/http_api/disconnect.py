"""A client that hangs up: the ASGI channel's ``http.disconnect``, and running a route's work
only for as long as its client is there (peers.md #5: a disconnect cancels the node work)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive

from gateway.frontend import Frontend

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the ASGI channel's ``http.disconnect``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, or None once the client hung up first: the work is cancelled then
    (its node calls with it). The work's errors propagate; it must not return None itself."""
    watch = asyncio.create_task(wait_for_disconnect(receive))
    task = asyncio.create_task(work)
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task in done else None
    finally:
        task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


def client_gone(frontend: Frontend, request_id: str) -> Response:
    """What a route returns once ``unless_disconnected`` found its client gone: counted as
    ``client_disconnected``; nobody reads the response."""
    logger.info("request %s: client disconnected", request_id)
    frontend.metrics.request_errors.labels(reason="client_disconnected").inc()
    return Response(status_code=499)
