"""Sending to the HTTP client over raw ASGI, for the responses FastAPI does not build."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.types import Send


async def send_json(
    send: Send,
    status: int,
    body: BaseModel | dict[str, object],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    content = body.model_dump_json().encode() if isinstance(body, BaseModel) else None
    if content is None:
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
