"""Sending to the HTTP client over raw ASGI, for the responses FastAPI does not build: a whole
JSON response, and a send bounded in time for clients that stop reading.

A client that does not read its SSE stream fills its socket buffers, then the server's transport
buffer (asyncio's high-water mark, 64 KiB); from then on uvicorn's ``send`` waits for the socket
to drain (flow control). ``bounded_send`` turns a wait longer than its bound into
``SlowClientError``, so that the response can abort the request instead of holding its slot and
its node legs for as long as the client stays connected.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.types import Message, Send


class SlowClientError(Exception):
    """One send to the client did not complete within the bound: the client stopped reading."""


def bounded_send(send: Send, timeout_s: float | None) -> Send:
    """``send`` that raises ``SlowClientError`` when one message waits over ``timeout_s`` to be
    taken; None: ``send`` itself, unbounded."""
    if timeout_s is None:
        return send

    async def send_within_bound(message: Message) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await send(message)
        except TimeoutError:
            # NOTE: uvicorn waits for the drain before writing, so the message cut off here was
            # not half-written; the response is incomplete all the same and must not send more.
            raise SlowClientError(
                f"the client read nothing for {timeout_s} s with its socket buffers full"
            ) from None

    return send_within_bound


async def send_json(
    send: Send,
    status: int,
    body: BaseModel | dict[str, object],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    if isinstance(body, BaseModel):
        content: bytes | memoryview = body.model_dump_json().encode()
    else:
        content = JSONResponse(body).body
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(content)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": content, "more_body": False})
