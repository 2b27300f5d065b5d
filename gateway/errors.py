"""The gateway's one error type, and how each kind maps onto HTTP, OpenAI and gRPC.

Anything a client can get wrong, or any refusal (auth, limits, no capacity), is raised as a
``GatewayError`` before the first byte of a response; the HTTP bridge renders it as an OpenAI
error body with the status below, the public gRPC API aborts with the status code below; either
counts it once in ``pdserve:request_errors_total`` under its ``reason`` (``gateway/metrics.py``).
An error after tokens were streamed is not an exception: it is a ``Finished`` with reason
``error``.
"""

from __future__ import annotations

import enum

import grpc

RETRY_AFTER_S = 1
"""The ``Retry-After`` of a 429: the server is full now; a second later a slot may be free."""


class ErrorKind(enum.Enum):
    # value: (HTTP status, OpenAI error type, gRPC status code)
    INVALID_ARGUMENT = (400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)
    # Right fields, wrong state of the server (a feature it was started without).
    FAILED_PRECONDITION = (400, "invalid_request_error", grpc.StatusCode.FAILED_PRECONDITION)
    UNAUTHENTICATED = (401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED)
    NOT_FOUND = (404, "not_found_error", grpc.StatusCode.NOT_FOUND)
    REQUEST_TIMEOUT = (408, "timeout", grpc.StatusCode.DEADLINE_EXCEEDED)
    PAYLOAD_TOO_LARGE = (413, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)
    RESOURCE_EXHAUSTED = (429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED)
    UNAVAILABLE = (503, "service_unavailable", grpc.StatusCode.UNAVAILABLE)
    DEADLINE_EXCEEDED = (504, "timeout", grpc.StatusCode.DEADLINE_EXCEEDED)

    @property
    def http_status(self) -> int:
        return self.value[0]

    @property
    def openai_type(self) -> str:
        return self.value[1]

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value[2]


class GatewayError(Exception):
    """A refusal with a message a client can act on; ``param`` names the offending field."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        param: str | None = None,
        *,
        retry_after_s: int | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        """Whole seconds after which a refused request may succeed (HTTP ``Retry-After``)."""
        self.reason = reason or kind.name.lower()
        """The ``pdserve:request_errors_total`` reason the front end counts the refusal under,
        once: the kind's name, or what raised it knows more precisely (``no_node``)."""

    def http_headers(self) -> list[tuple[bytes, bytes]]:
        """Extra response headers: a 429 says when to come back (its own ``retry_after_s``, as a
        key's limiter computes it, or RETRY_AFTER_S)."""
        if self.retry_after_s is not None:
            return [(b"retry-after", str(self.retry_after_s).encode())]
        if self.kind is ErrorKind.RESOURCE_EXHAUSTED:
            return [(b"retry-after", str(RETRY_AFTER_S).encode())]
        return []

    def openai_body(self) -> dict[str, object]:
        """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API sends it."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind.openai_type,
                "param": self.param,
                "code": self.kind.http_status,
            }
        }


def invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(ErrorKind.INVALID_ARGUMENT, message, param)


def invalid_from(error: ValueError) -> GatewayError:
    """A refusal raised by the shared code (``services.chat_template.ChatRequestError``), whose
    ``param`` names the request's field, as the gateway's 400."""
    return invalid(str(error), getattr(error, "param", None))
