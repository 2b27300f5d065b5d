"""OpenAI's ``POST /v1/embeddings`` (and vLLM's extensions of it): each input's embedding, the
final hidden state of its last token as a node computes it (``services/engine/pooler.py``).

Life of one request: the API key and the key's limits as a generation's (``HttpGate``) → the
model (404) and fields (400) → an admission slot (429) → inputs tokenized off the event loop,
each checked against the vocabulary and ``max_model_len`` (400 naming ``input``) → every input
sent at once, each to a node that computes prompts (``Embedder``: a prefill or colocated node),
where they batch with other requests' steps → one JSON body, in input order. The first input a
node refuses fails the request and cancels the others' node calls; so does the deadline
(``--request-timeout-s``: 504), and a client that hangs up. The key is charged each input's
prompt tokens.

    {"model", "input": "text" | ["text", ...] | [ids] | [[ids], ...], "encoding_format":
     "float" | "base64", "dimensions", "user", vLLM's "truncate_prompt_tokens",
     "add_special_tokens", "normalize", "priority"}
    → {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
       "usage": {"prompt_tokens", "total_tokens"}}

``base64`` is the vector's float32 values, little-endian, as OpenAI's SDK (its default) and
vLLM encode them.
"""

from __future__ import annotations

import base64
import logging
import struct
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request, Security
from fastapi.responses import Response
from fastapi.security import HTTPBearer
from pydantic import Field

from gateway.embedding import Embedding
from gateway.embeddings import MAX_INPUTS, embed_all, embedding_prompts
from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.frontend import Frontend
from gateway.generation import CLIENT_REQUEST_ID
from gateway.http_api.disconnect import client_gone, unless_disconnected
from gateway.http_api.openai_job import check_model
from gateway.http_api.openai_protocol import (
    NonEmptyText,
    RequestModel,
    ResponseModel,
    TokenIds,
    TrueFlag,
)
from gateway.pipeline import admitted
from services.types import PoolingParams, SamplingParamError

logger = logging.getLogger(__name__)


class EmbeddingCreateRequest(RequestModel):
    model: str | None = None
    input: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    """A string, a batch of strings, a list of token ids, or a batch of token-id lists."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    """The first N values only, normalized again (a Matryoshka model's shorter embedding)."""
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep each input's last N tokens (-1: ``max_model_len``)."""
    add_special_tokens: TrueFlag = True
    """vLLM's: text inputs tokenized with the tokenizer's special tokens (BOS)."""
    normalize: bool | None = None
    """vLLM's: L2-normalize the embeddings (false: the raw hidden state); unset: as the
    model's sentence-transformers modules do, normalized for a model without them."""
    priority: int = 0
    """vLLM's: lower is served first (nodes with ``--scheduling-policy priority``)."""


class EmbeddingData(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def embeddings_router(
    frontend: Frontend, bearer: HTTPBearer, errors: dict[int | str, dict[str, object]]
) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Security(bearer)])

    @router.post("/embeddings", response_model=EmbeddingResponse, responses=errors)
    async def create_embedding(
        body: EmbeddingCreateRequest, request: Request
    ) -> EmbeddingResponse | Response:
        """Each input's embedding (last-token pooling), in input order."""
        if frontend.embedder is None:
            raise GatewayError(ErrorKind.NOT_FOUND, "this server does not serve embeddings")
        check_model(body.model, frontend)
        request_id = _request_id(request)
        arrival: float = request.state.arrival
        keep = frontend.limits.prompt_tokens_kept(
            body.truncate_prompt_tokens, "truncate_prompt_tokens"
        )
        try:
            pooling = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
        except SamplingParamError as exc:
            raise invalid(str(exc), param=exc.param) from None
        given = body.input
        inputs: list[str] | list[list[int]]
        if isinstance(given, str):
            inputs = [given]
        elif given and isinstance(given[0], int):
            inputs = [[int(token_id) for token_id in given]]
        else:
            inputs = given  # type: ignore[assignment]  # a batch of texts or of id lists
        result = await unless_disconnected(
            request.receive, _embed(frontend, body, request_id, keep, pooling, inputs, arrival)
        )
        if result is None:
            return client_gone(frontend, request_id)
        prompts, embeddings = result
        num_tokens = sum(map(len, prompts))
        return EmbeddingResponse(
            id=f"embd-{request_id}",
            created=int(time.time()),
            model=frontend.response_model(body.model),
            data=[
                EmbeddingData(index=index, embedding=_encoded(embedding.vector, body))
                for index, embedding in enumerate(embeddings)
            ],
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    return router


async def _embed(
    frontend: Frontend,
    body: EmbeddingCreateRequest,
    request_id: str,
    keep: int | None,
    pooling: PoolingParams,
    inputs: list[str] | list[list[int]],
    arrival: float,
) -> tuple[list[tuple[int, ...]], list[Embedding]]:
    """An admission slot, then the inputs' token ids and their embeddings."""
    async with admitted(frontend):
        prompts = await embedding_prompts(
            inputs,
            frontend,
            add_special_tokens=body.add_special_tokens,
            keep=keep,
            param="input",
        )
        embeddings = await embed_all(
            frontend,
            prompts,
            request_id=request_id,
            pooling=pooling,
            priority=body.priority,
            lora_name=frontend.lora_name(body.model),
            deadline=None
            if frontend.request_timeout_s is None
            else arrival + frontend.request_timeout_s,
        )
    return prompts, embeddings


def _request_id(request: Request) -> str:
    request_id = request.headers.get("x-request-id")
    if request_id is None:
        return uuid.uuid4().hex
    if not CLIENT_REQUEST_ID.fullmatch(request_id):
        raise invalid("X-Request-Id must be 1 to 128 characters of [A-Za-z0-9._:-]")
    return request_id


def _encoded(vector: list[float], body: EmbeddingCreateRequest) -> list[float] | str:
    if body.encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
