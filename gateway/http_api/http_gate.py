"""The edge of the HTTP API: auth, per-key limits, body size and body-read stalls, checked
before FastAPI reads anything."""

from __future__ import annotations

import asyncio
import contextlib
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.frontend import Frontend
from gateway.http_api.client_send import send_json
from gateway.http_api.score_api import RERANK_PATHS, SCORE_PATHS

GENERATION_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
     *SCORE_PATHS, *RERANK_PATHS}
)  # fmt: skip
"""The routes a key's limits count (each request runs prompts on the nodes)."""
KEYED_PATHS_OUTSIDE_V1 = frozenset(
    path for path in ("/tokenize", "/detokenize", *SCORE_PATHS, *RERANK_PATHS)
    if not path.startswith("/v1/")
)  # fmt: skip
"""vLLM's paths outside ``/v1`` (the tokenizer's, ``tokenize_api.py``; score and rerank,
``score_api.py``): keyed as ``/v1/*`` is."""


class ClientDisconnected(Exception):
    """The client went away before its request body arrived whole."""


class HttpGate:
    """ASGI middleware: arrival time, the API key on ``/v1/*`` and the tokenizer's paths, the
    key's limits on the generation routes (held until the response has been sent), and the
    body-size bound.

    The body is read here, whole, so that its size is known before FastAPI parses it (a client
    may lie in Content-Length or send chunked); the app then receives it as one message.
    """

    def __init__(self, app: ASGIApp, frontend: Frontend) -> None:
        self._app = app
        self._frontend = frontend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrival"] = time.monotonic()
        headers = {name.lower(): value for name, value in scope["headers"]}
        with contextlib.ExitStack() as held:
            try:
                path = scope["path"]
                if path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS_OUTSIDE_V1:
                    authorization = headers.get(b"authorization")
                    key = self._frontend.api_keys.check(
                        None if authorization is None else authorization.decode("latin-1")
                    )
                    # Whose request it is (stored responses are the key's own).
                    scope["state"]["api_key"] = None if key is None else key.name
                    if path in GENERATION_PATHS:  # listing models costs nothing
                        held.enter_context(self._frontend.key_limiter.hold(key))
                body = await self._read_body(receive, headers.get(b"content-length"))
            except GatewayError as error:
                self._frontend.metrics.request_errors.labels(reason=error.kind.name.lower()).inc()
                extra = []
                if error.kind is ErrorKind.UNAUTHENTICATED:
                    extra = [(b"www-authenticate", b"Bearer")]
                extra += error.http_headers()
                await send_json(send, error.kind.http_status, error.openai_body(), extra)
                return
            except ClientDisconnected:
                return
            is_replayed = False

            async def replay() -> Message:
                nonlocal is_replayed
                if not is_replayed:
                    is_replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            # The key's request stays in flight until the whole response has been sent.
            await self._app(scope, replay, send)

    async def _read_body(self, receive: Receive, content_length: bytes | None) -> bytes:
        max_bytes = self._frontend.limits.max_body_bytes
        if content_length is not None:
            try:
                declared = int(content_length)
            except ValueError:
                raise invalid("Content-Length is not a number") from None
            if declared > max_bytes:
                raise _too_large(max_bytes)
        chunks: list[bytes] = []
        size = 0
        stall_s = self._frontend.limits.body_read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), stall_s)
            except TimeoutError:
                # A body that stops arriving would hold this request (and its connection) for
                # ever: answered 408, as the flag --body-read-timeout-s documents.
                raise GatewayError(
                    ErrorKind.REQUEST_TIMEOUT,
                    f"the request body stalled: no byte for {stall_s} s (--body-read-timeout-s)",
                ) from None
            if message["type"] == "http.disconnect":
                raise ClientDisconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(max_bytes: int) -> GatewayError:
    return GatewayError(
        ErrorKind.PAYLOAD_TOO_LARGE, f"request body is larger than {max_bytes} bytes"
    )
