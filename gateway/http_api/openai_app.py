"""The OpenAI-compatible HTTP/SSE front end: ``build_openai_app(frontend) -> FastAPI``.

Life of one ``/v1/completions``, ``/v1/chat/completions`` or ``/v1/responses`` request here
(a Responses request runs as the chat it means, ``responses_job.py``):

0. ``CORSMiddleware`` (``--allowed-origins`` and the like): a browser's preflight ``OPTIONS``
   is answered here, before any API key is asked for (as vLLM); other responses get the
   ``Access-Control-Allow-*`` headers.
1. ``HttpGate`` (ASGI middleware, ``http_gate.py``): arrival time; the API key on ``/v1/*``
   (401); the body read whole and bounded by ``limits.max_body_bytes``, by Content-Length and by
   the bytes themselves (413).
2. FastAPI parses the body into the strict request model; any mismatch is a 400 naming the field
   (``openai_errors.py``).
3. The route checks what needs no tokenizer (model name, unsupported features, limits) into an
   ``OpenAIJob`` (``openai_job.py``), in a worker thread: compiling a structured-output grammar
   takes seconds for a large one, and would stall every other stream on the event loop
   (llguidance releases the GIL). It returns a ``GenerationResponse``, which owns everything
   after (``generation_response.py``):
4. while a task watches the ASGI receive channel for the client's disconnect: an admission slot
   (429) → tokenization and length checks (400) → one generation per choice, all started at once
   (``choice_fanout.py``) → each choice's first event (a ``GatewayError`` here is the response's
   status, also when streaming) → SSE chunks as tokens arrive, or one JSON body at the end
   (``openai_format.py``).
5. A disconnect at any point cancels step 4, and so does a client that stops reading (one send
   blocked past ``frontend.client_send_timeout_s``); closing each choice's event iterator is
   what cancels its node legs. The admission slot is released when step 4 ends, however it ends.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
import uuid

from fastapi import APIRouter, FastAPI, Request, Security
from fastapi.responses import PlainTextResponse, Response
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.middleware.cors import CORSMiddleware

from gateway.config import CorsConfig
from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.frontend import Frontend
from gateway.http_api.embeddings_api import embeddings_router
from gateway.http_api.generation_response import GenerationResponse
from gateway.http_api.http_gate import HttpGate
from gateway.http_api.openai_errors import drop_fastapi_422, install_error_handlers
from gateway.http_api.openai_job import chat_job, check_model, completion_job
from gateway.http_api.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from gateway.http_api.response_store import Message, ResponseStore, StoredResponse
from gateway.http_api.responses_format import ResponsesFormat
from gateway.http_api.responses_job import input_messages, responses_job
from gateway.http_api.responses_protocol import ResponseDeleted, ResponseObject, ResponsesRequest
from gateway.http_api.score_api import score_router
from gateway.http_api.sse import MEDIA_TYPE
from gateway.http_api.tokenize_api import tokenize_router
from gateway.lora_admin import load_adapter, unload_adapter

try:
    _VERSION = importlib.metadata.version("pdserve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    _VERSION = "unknown"

_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request: `error.param` names the offending field"),
        (401, "Missing or invalid API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "Server at capacity; retry later"),
        (503, "No healthy node, or the generation failed"),
        (504, "The request's deadline passed"),
    )
}
_LORA_ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "A field, or an adapter a node refused (its files, max_loras, LoRA off there)"),
        (401, "Missing or invalid API key"),
        (404, "No node has the adapter (unload)"),
        (503, "No healthy node, or a node did not answer"),
    )
}
_HEALTH_RESPONSES: dict[int | str, dict[str, object]] = {
    503: {"model": ErrorResponse, "description": "No healthy node"}
}
_STREAM_RESPONSE: dict[int | str, dict[str, object]] = {
    200: {
        "description": "JSON, or with `stream: true` server-sent events: `data: {chunk}` "
        "lines, then `data: [DONE]`",
        "content": {MEDIA_TYPE: {"schema": {"type": "string"}}},
    }
}

_RESPONSES_STREAM: dict[int | str, dict[str, object]] = {
    200: {
        "description": "A response object, or with `stream: true` its events as server-sent "
        "events (`event: <type>` and `data: {event}` lines, no `[DONE]`)",
        "content": {MEDIA_TYPE: {"schema": {"type": "string"}}},
    }
}


def build_openai_app(frontend: Frontend, cors: CorsConfig | None = None) -> FastAPI:
    """The HTTP API of one gateway: OpenAI routes under ``/v1``, vLLM's ``/tokenize``,
    ``/detokenize`` and ``/ping``, ``/health`` and ``/metrics``; ``cors``: which browser pages
    may call it (None: vLLM's default, any)."""
    cors = CorsConfig() if cors is None else cors
    app = FastAPI(
        title="pdserve",
        summary="OpenAI-compatible API of a disaggregated prefill/decode LLM server",
        version="0.1.0",
    )
    metrics = frontend.metrics
    # Read at scrape time, so always exact: Admission counts for every front end sharing it.
    metrics.num_requests_running.set_function(lambda: frontend.admission.num_running)
    metrics.num_requests_waiting.set_function(lambda: frontend.admission.num_queued)
    app.add_middleware(HttpGate, frontend=frontend)
    # Added last, so outermost: a preflight never reaches HttpGate's key check, and the gate's
    # own refusals (401, 413, 429) carry the CORS headers a browser needs to read them.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(cors.allowed_origins),
        allow_methods=list(cors.allowed_methods),
        allow_headers=list(cors.allowed_headers),
        allow_credentials=cors.allow_credentials,
    )
    install_error_handlers(app, frontend)
    drop_fastapi_422(app)
    created = int(time.time())
    size = frontend.responses_store_size
    responses = ResponseStore(size) if size > 0 else None
    if responses is not None:
        kept = responses  # read at scrape time, as the admission gauges above
        metrics.responses_stored.set_function(lambda: len(kept))
        metrics.responses_stored_chars.set_function(lambda: kept.num_chars)

    # auto_error=False: HttpGate enforces the key (before the body is read); this declares the
    # scheme in the OpenAPI document.
    bearer = HTTPBearer(auto_error=False)
    v1 = APIRouter(prefix="/v1", dependencies=[Security(bearer)])

    @v1.post(
        "/completions",
        response_model=CompletionResponse,
        responses={**_STREAM_RESPONSE, **_ERROR_RESPONSES},
    )
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        job = await asyncio.to_thread(completion_job, body, request, frontend)
        return GenerationResponse(frontend, job)

    @v1.post(
        "/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_STREAM_RESPONSE, **_ERROR_RESPONSES},
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        job = await asyncio.to_thread(chat_job, body, request, frontend)
        return GenerationResponse(frontend, job)

    @v1.post(
        "/responses",
        response_model=ResponseObject,
        responses={**_RESPONSES_STREAM, **_ERROR_RESPONSES},
    )
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API over the chat pipeline (``responses_job.py``)."""
        owner = _api_key(request)
        history: tuple[Message, ...] = ()
        if body.previous_response_id is not None:
            history = _stored(body.previous_response_id, owner, "previous_response_id").conversation
        job = await asyncio.to_thread(responses_job, body, request, frontend, history)
        # The id a stored response is found by is the server's own, never a client's
        # X-Request-Id (which stays the request's id in logs and on the nodes): a client could
        # otherwise name another's response and replace it.
        response_id = (
            job.request_id if "x-request-id" not in request.headers else f"resp-{uuid.uuid4().hex}"
        )
        on_end = None
        if responses is not None and body.store is not False:
            store, turns = responses, [*history, *input_messages(body)]

            def on_end(final: ResponseObject, reply: Message) -> None:
                store.put(final.id, final.model_dump(), [*turns, reply], owner)

        model = frontend.response_model(body.model)
        output = ResponsesFormat(job, frontend.tokenizer, model, body, on_end, response_id)
        return GenerationResponse(frontend, job, output)

    def _stored(response_id: str, owner: str | None, param: str | None = None) -> StoredResponse:
        if responses is None:
            raise GatewayError(
                ErrorKind.FAILED_PRECONDITION,
                "responses are not stored on this server (--responses-store-size 0)",
                param,
            )
        stored = responses.get(response_id, owner)
        if stored is None:
            # Another key's response reads as absent too: its existence is not told.
            raise GatewayError(
                ErrorKind.NOT_FOUND, f"no stored response with id {response_id!r}", param
            )
        return stored

    @v1.get(
        "/responses/{response_id}",
        response_model=ResponseObject,
        responses={401: _ERROR_RESPONSES[401], 404: _ERROR_RESPONSES[404]},
    )
    async def retrieve_response(response_id: str, request: Request) -> dict[str, object]:
        """A stored response, as it was returned."""
        return _stored(response_id, _api_key(request)).response

    @v1.delete(
        "/responses/{response_id}",
        response_model=ResponseDeleted,
        responses={401: _ERROR_RESPONSES[401], 404: _ERROR_RESPONSES[404]},
    )
    async def delete_response(response_id: str, request: Request) -> ResponseDeleted:
        _stored(response_id, _api_key(request))
        assert responses is not None
        responses.delete(response_id, _api_key(request))
        return ResponseDeleted(id=response_id)

    def model_card(name: str) -> ModelCard:
        return ModelCard(
            id=name,
            created=created,
            max_model_len=frontend.limits.max_model_len,
            root=frontend.served_model_name,  # an alias's too, as vLLM's cards all name the model
            parent=frontend.served_model_name if name in frontend.lora_names else None,
        )

    @v1.get("/models", response_model=ModelList, responses={401: _ERROR_RESPONSES[401]})
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(name) for name in frontend.model_names])

    @v1.get(
        "/models/{model}",
        response_model=ModelCard,
        responses={401: _ERROR_RESPONSES[401], 404: _ERROR_RESPONSES[404]},
    )
    async def retrieve_model(model: str) -> ModelCard:
        check_model(model, frontend)
        return model_card(model)

    if frontend.lora_updates is not None:  # vLLM's routes exist only with runtime updates on

        @v1.post("/load_lora_adapter", response_class=PlainTextResponse, responses=_LORA_ERRORS)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
            """Load a LoRA adapter on every node, served as the model ``lora_name``."""
            if body.load_inplace:
                raise invalid(
                    "load_inplace is not supported: unload the adapter, then load it",
                    param="load_inplace",
                )
            return PlainTextResponse(await load_adapter(frontend, body.lora_name, body.lora_path))

        @v1.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=_LORA_ERRORS)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            """Unload a LoRA adapter from every node: new requests may not name it, and the
            requests running with it finish with it."""
            return PlainTextResponse(await unload_adapter(frontend, body.lora_name))

    app.include_router(v1)
    app.include_router(embeddings_router(frontend, bearer, _ERROR_RESPONSES))
    app.include_router(score_router(frontend, bearer, _ERROR_RESPONSES))
    app.include_router(tokenize_router(frontend, bearer))

    @app.get("/health", responses=_HEALTH_RESPONSES)
    async def health() -> dict[str, object]:
        """200 while a pair or a colocated node can serve (what load balancers and probes read);
        the body also counts the healthy and known nodes of each role, since one ready pair is
        not every pair ready (the local launcher waits for all of them)."""
        census = frontend.node_census()
        if not census.is_ready:
            raise GatewayError(ErrorKind.UNAVAILABLE, "no healthy prefill/decode pair or node")
        return {"status": "ok", "nodes": census.as_json()}

    # vLLM's /ping (SageMaker's probe), GET or POST: what /health answers. One route per
    # method: one route of both would give the OpenAPI document one operation id twice.
    for method in ("GET", "POST"):
        app.add_api_route(
            "/ping", health, methods=[method], responses=_HEALTH_RESPONSES, name=f"ping_{method}"
        )

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's ``/version``: the version of the pdserve package serving (no key needed)."""
        return {"version": _VERSION}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}},
    )
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _api_key(request: Request) -> str | None:
    """The name of the API key the request came with (``HttpGate``); None without keys."""
    return getattr(request.state, "api_key", None)
