"""Calling a gRPC method with raw bytes, as a client whose messages do not parse would."""

from __future__ import annotations

import grpc
import pytest


async def refused_raw_call(
    channel: grpc.aio.Channel, method: str, kind: str, payload: bytes
) -> grpc.aio.AioRpcError:
    """Send ``payload`` unparsed to ``method`` (``kind``: ``unary_unary`` or ``unary_stream``)
    and return the error it must end in."""
    multi = getattr(channel, kind)(
        method, request_serializer=lambda x: x, response_deserializer=lambda x: x
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        if kind == "unary_stream":
            async for _ in multi(payload, timeout=10):
                pass
        else:
            await multi(payload, timeout=10)
    return refused.value
