"""Server-sent events as the OpenAI streaming API frames them: one ``data: {json}`` event per
chunk, a blank line after each, and ``data: [DONE]`` last. No ``event:`` or ``id:`` lines: the
OpenAI clients read only ``data``."""

from __future__ import annotations

import json

from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def sse_event(payload: BaseModel | dict[str, object], exclude: set[str] | None = None) -> bytes:
    """``data: <payload as compact JSON>\\n\\n``; JSON never holds a raw newline, so one line.
    ``exclude``: fields of a model payload left out."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude=exclude)
    else:
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return b"data: " + data.encode() + b"\n\n"
