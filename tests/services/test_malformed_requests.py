"""RejectMalformedRequests over real gRPC on localhost: bytes that are not a request of the
method's type get INVALID_ARGUMENT naming the type, for each handler shape grpc.aio tells apart
(unary, async-generator stream, ``context.write`` stream, streamed requests), with nothing logged
at ERROR; well-formed requests pass through unchanged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from services.malformed_requests import RejectMalformedRequests

BAD_UTF8 = b"\x0a\x03\xff\xfe\x41"  # field 1, a string, holding bytes that are not UTF-8
CORRUPT = b"\xff\xff\xff"  # not a protobuf wire format at all
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"  # a coroutine that writes: context.write
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
ECHO = "/test.Echo/Stream"  # an async generator


class _Echo:
    """An async-generator unary-stream method: yields the request's service twice."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def stream(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> AsyncIterator[health_pb2.HealthCheckRequest]:
        try:
            for _ in range(2):
                yield request
                await asyncio.sleep(0)
            await asyncio.Event().wait()  # then holds the stream open until the client leaves
        finally:
            self.closed.set()


async def _serve(echo: _Echo) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    server = grpc.aio.server(interceptors=[RejectMalformedRequests()])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    reflection.enable_server_reflection(("grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    handler = grpc.unary_stream_rpc_method_handler(
        echo.stream,
        request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckRequest.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Echo", {"Stream": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def _raw(kind: str, channel: grpc.aio.Channel, method: str) -> Callable[..., Any]:
    """A multi-callable that sends and returns bytes as they are."""
    make = getattr(channel, kind)
    return make(method, request_serializer=lambda x: x, response_deserializer=lambda x: x)  # type: ignore[no-any-return]


async def _status(call: Any) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """(code, details, responses) of a call read to its end."""
    responses: list[bytes] = []
    try:
        if isinstance(call, Awaitable):
            responses.append(await call)
        else:
            async for response in call:
                responses.append(response)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", responses
    return grpc.StatusCode.OK, "", responses


@pytest.mark.parametrize("payload", [BAD_UTF8, CORRUPT], ids=["bad-utf8", "corrupt"])
def test_malformed_requests_are_invalid_argument_for_every_handler_shape(
    payload: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        echo = _Echo()
        server, channel = await _serve(echo)
        reflection_first = reflection_pb2.ServerReflectionRequest(list_services="")
        calls = {
            "unary": _raw("unary_unary", channel, HEALTH_CHECK)(payload, timeout=5),
            "async generator": _raw("unary_stream", channel, ECHO)(payload, timeout=5),
            "context.write": _raw("unary_stream", channel, HEALTH_WATCH)(payload, timeout=5),
            # A good request, then a bad one: the stream is refused at the bad one.
            "streamed requests": _raw("stream_stream", channel, REFLECTION)(
                iter([reflection_first.SerializeToString(), payload]), timeout=5
            ),
        }
        try:
            for shape, call in calls.items():
                code, details, _ = await _status(call)
                assert code is grpc.StatusCode.INVALID_ARGUMENT, (shape, code, details)
                assert details.startswith("malformed request: Error parsing message with type")
                assert "HealthCheckRequest" in details or "ServerReflectionRequest" in details
            assert not echo.closed.is_set()  # the servicer never ran
        finally:
            await channel.close()
            await server.stop(0)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_well_formed_requests_pass_and_a_stream_left_early_closes_the_servicer() -> None:
    async def main() -> None:
        echo = _Echo()
        server, channel = await _serve(echo)
        try:
            check = health_pb2_grpc.HealthStub(channel).Check
            reply = await check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            request = health_pb2.HealthCheckRequest(service="svc")
            call = _raw("unary_stream", channel, ECHO)(request.SerializeToString(), timeout=5)
            responses = [await call.read(), await call.read()]
            assert [health_pb2.HealthCheckRequest.FromString(r) for r in responses] == [request] * 2
            call.cancel()
            await asyncio.wait_for(echo.closed.wait(), timeout=5)
            unknown = _raw("unary_unary", channel, "/test.Echo/Missing")(b"", timeout=5)
            assert (await _status(unknown))[0] is grpc.StatusCode.UNIMPLEMENTED
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(main())
