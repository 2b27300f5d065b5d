"""Errors in the OpenAI shape (``{"error": {"message", "type", "param", "code"}}``).

``GatewayError``s and FastAPI's own errors (validation, unknown routes) alike are rendered so;
validation errors are 400s, not FastAPI's 422, in the responses and in the OpenAPI document.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.frontend import Frontend

_VALIDATION_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def internal_error_body() -> dict[str, object]:
    return {"error": {"message": "internal error", "type": "internal_error", "param": None,
                      "code": 500}}  # fmt: skip


def install_error_handlers(app: FastAPI, frontend: Frontend) -> None:
    errors = frontend.metrics.request_errors

    @app.exception_handler(GatewayError)
    async def on_gateway_error(request: Request, error: GatewayError) -> JSONResponse:
        # Requests only: /health answering 503 while the nodes start is not a request error.
        if request.url.path.startswith("/v1"):
            errors.labels(reason=error.kind.name.lower()).inc()
        headers = {name.decode(): value.decode() for name, value in error.http_headers()}
        return JSONResponse(
            error.openai_body(), status_code=error.kind.http_status, headers=headers or None
        )

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors.labels(reason="invalid_argument").inc()
        return JSONResponse(_validation_error(exc).openai_body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: ErrorKind.NOT_FOUND, 413: ErrorKind.PAYLOAD_TOO_LARGE}.get(
            exc.status_code, ErrorKind.INVALID_ARGUMENT
        )
        errors.labels(reason=kind.name.lower()).inc()
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        body = GatewayError(kind, message).openai_body()
        body["error"]["code"] = exc.status_code  # type: ignore[index]
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _validation_error(exc: RequestValidationError) -> GatewayError:
    """The first pydantic error as a GatewayError whose param is the field path."""
    details = list(exc.errors())
    if not details:
        return invalid("invalid request")
    first = details[0]
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    if loc and isinstance(loc[0], str) and loc[0][:1].isupper():
        # A body that is a union of models (/tokenize's): pydantic names the member, a class,
        # first; it is no part of the field's path (request fields are snake_case).
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return invalid(f"the request body is not valid JSON: {reason}".rstrip(": "))
    if not loc:
        if first.get("type") == "missing":
            return invalid("a JSON request body is required")
        if isinstance(first.get("input"), dict):  # e.g. a key that is not valid Unicode
            return invalid(f"invalid request body: {first.get('msg', '')}")
        return invalid("the request body must be a JSON object (Content-Type: application/json)")
    if first.get("type") == "extra_forbidden":
        # The last element is the unknown key itself, whatever characters it holds.
        key = str(loc[-1]).encode("utf-8", "backslashreplace").decode()
        path = _field_path(loc[:-1])
        path = f"{path}.{key}" if path else key
        return invalid(f"unsupported parameter: {path}", param=path)
    path = _field_path(loc)
    message = f"{path}: {first.get('msg', 'invalid value')}"
    if any(isinstance(part, str) and not _is_field_name(part) and ":" not in part for part in loc):
        # pydantic names the member of a union it tried: it is no part of the field's path.
        message += " (the value matches none of the types this field accepts)"
    return invalid(message, param=path)


def _field_path(loc: Sequence[int | str]) -> str:
    """``("messages", 0, "content")`` → ``messages[0].content``, without union member tags:
    pydantic's names of the members it tried, and a discriminated union's ``Tag``s, which the
    request models write ``kind:name`` (``item:function_call``) so that they read as none."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_field_name(part):
            path += f".{part}" if path else part
    return path


def _is_field_name(part: str) -> bool:
    return part.isidentifier() and part.lower() not in _VALIDATION_TYPE_NAMES


def drop_fastapi_422(app: FastAPI) -> None:
    """Validation errors are 400s here; drop the 422 FastAPI documents on every operation."""
    build = app.openapi

    def openapi() -> dict[str, object]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
