"""Refusing a gRPC request whose bytes are not a valid message of its type (a corrupt wire
format, a string field that is not UTF-8) with ``INVALID_ARGUMENT``, for every RPC of a
``grpc.aio`` server: the gateway's public services and the nodes'.

Without it grpc.aio parses the request before any servicer code runs, so a ``DecodeError``
escapes to the server, which answers ``UNKNOWN`` and logs a traceback at ERROR: any client could
fill the log. The interceptor moves the parse into the handler, where a failure can abort:

- a unary request reaches the handler as raw bytes (no deserializer) and is parsed there;
- a streamed request keeps its deserializer, and the iterator the servicer reads raises the
  abort in place of the ``DecodeError``.

NOTE: only async handlers are guarded (every servicer here is one); a sync handler is left as
grpc registered it.

Such a call never reaches the servicer, so whatever counts the servicer's refusals does not see
it: ``on_refused`` is told the method of each one, once (the gateway counts those of its API in
its ``request_errors``; this module knows no metrics, and no role).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeAlias

import grpc
from google.protobuf.message import DecodeError

_Context = grpc.aio.ServicerContext[Any, Any]
_Deserializer = Callable[[bytes], Any]
_OnRefused = Callable[[], None]
# A string: grpc.RpcMethodHandler is generic in its stubs only, not at run time.
_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


class RejectMalformedRequests(grpc.aio.ServerInterceptor):
    """``grpc.aio.server(interceptors=[RejectMalformedRequests()])``.

    ``on_refused``: called with the full method name (``/pkg.Service/Method``) of each call
    refused here, once, before the status is sent; None: nobody is told.
    """

    def __init__(self, on_refused: Callable[[str], None] | None = None) -> None:
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: grpc answers UNIMPLEMENTED
            return handler
        on_refused = None
        if self._on_refused is not None:
            on_refused = functools.partial(self._on_refused, handler_call_details.method)
        return guarded(handler, on_refused)


def guarded(handler: _Handler, on_refused: _OnRefused | None = None) -> _Handler:
    """``handler`` with its request parse failures answered ``INVALID_ARGUMENT``, each call's
    first told to ``on_refused``."""
    deserialize = handler.request_deserializer
    if deserialize is None:  # raw bytes: nothing to parse
        return handler
    # grpc's own handlers are namedtuples (grpc._utilities.RpcMethodHandler); the stubs say not.
    replace: Callable[..., _Handler] = handler._replace  # type: ignore[attr-defined]
    if handler.unary_unary is not None and _is_async(handler.unary_unary):
        unary_unary = _parsed_call(handler.unary_unary, deserialize, on_refused)
        return replace(request_deserializer=None, unary_unary=unary_unary)
    if handler.unary_stream is not None and _is_async(handler.unary_stream):
        unary_stream = _parsed_call(handler.unary_stream, deserialize, on_refused)
        return replace(request_deserializer=None, unary_stream=unary_stream)
    if handler.stream_unary is not None and _is_async(handler.stream_unary):
        return replace(stream_unary=_checked_stream_call(handler.stream_unary, on_refused))
    if handler.stream_stream is not None and _is_async(handler.stream_stream):
        return replace(stream_stream=_checked_stream_call(handler.stream_stream, on_refused))
    return handler


def _is_async(behavior: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


async def _refuse(context: _Context, exc: DecodeError, on_refused: _OnRefused | None) -> NoReturn:
    """Raises grpc's ``AbortError`` once the status is sent (a client error: no log)."""
    if on_refused is not None:
        on_refused()
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")


async def _parse(
    raw: bytes, deserialize: _Deserializer, context: _Context, on_refused: _OnRefused | None
) -> Any:
    try:
        return deserialize(raw)
    except DecodeError as exc:
        await _refuse(context, exc, on_refused)


def _parsed_call(
    behavior: Callable[..., Any], deserialize: _Deserializer, on_refused: _OnRefused | None
) -> Callable[..., Any]:
    """``behavior`` taking raw bytes. grpc.aio tells an async generator (responses yielded) from
    a coroutine (a unary response, or ``context.write``) by the function's kind: the wrapper
    keeps it."""
    if inspect.isasyncgenfunction(behavior):

        async def responses(raw: bytes, context: _Context) -> AsyncIterator[Any]:
            request = await _parse(raw, deserialize, context, on_refused)
            # aclosing: a stream closed early (the client went away) closes the servicer's too,
            # so its cleanup runs now rather than when the collector finds it.
            async with contextlib.aclosing(behavior(request, context)) as stream:
                async for response in stream:
                    yield response

        return responses

    async def call(raw: bytes, context: _Context) -> Any:
        return await behavior(await _parse(raw, deserialize, context, on_refused), context)

    return call


def _checked_stream_call(
    behavior: Callable[..., Any], on_refused: _OnRefused | None
) -> Callable[..., Any]:
    """``behavior`` reading requests that raise the abort instead of a ``DecodeError``."""

    async def checked(requests: AsyncIterator[Any], context: _Context) -> AsyncIterator[Any]:
        try:
            async for request in requests:
                yield request
        except DecodeError as exc:
            await _refuse(context, exc, on_refused)

    if inspect.isasyncgenfunction(behavior):

        async def responses(requests: AsyncIterator[Any], context: _Context) -> AsyncIterator[Any]:
            async with contextlib.aclosing(behavior(checked(requests, context), context)) as stream:
                async for response in stream:
                    yield response

        return responses

    async def call(requests: AsyncIterator[Any], context: _Context) -> Any:
        return await behavior(checked(requests, context), context)

    return call
