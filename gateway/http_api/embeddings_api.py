"""OpenAI's ``POST /v1/embeddings`` (and vLLM's extensions of it): each input's embedding, the
final hidden state of its last token as a node computes it (``services/engine/pooler.py``).

Life of one request: the API key and the key's limits as a generation's (``HttpGate``) → the
model (404) and fields (400) → an admission slot (429) → inputs tokenized off the event loop,
each checked against the vocabulary and ``max_model_len`` (400 naming ``input``) → every input
sent at once, each to a node that computes prompts (``Embedder``: a prefill or colocated node),
where they batch with other requests' steps → one JSON body, in input order. The first input a
node refuses fails the request and cancels the others' node calls; so does the deadline
(``--request-timeout-s``: 504). The key is charged each input's prompt tokens.

    {"model", "input": "text" | ["text", ...] | [ids] | [[ids], ...], "encoding_format":
     "float" | "base64", "dimensions", "user", vLLM's "truncate_prompt_tokens",
     "add_special_tokens", "normalize", "priority"}
    → {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
       "usage": {"prompt_tokens", "total_tokens"}}

``base64`` is the vector's float32 values, little-endian, as OpenAI's SDK (its default) and
vLLM encode them.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request, Security
from fastapi.security import HTTPBearer
from pydantic import Field

from gateway.embedding import EmbeddingRequest
from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.frontend import Frontend
from gateway.generation import CLIENT_REQUEST_ID
from gateway.http_api.openai_job import check_model
from gateway.http_api.openai_protocol import (
    NonEmptyText,
    RequestModel,
    ResponseModel,
    TokenIds,
    TrueFlag,
)
from gateway.key_limiter import current_lease
from gateway.pipeline import admitted
from gateway.text.tokenizer import Tokenizer
from services.types import PoolingParams, SamplingParamError

MAX_INPUTS = 2048
"""Inputs one request may carry (OpenAI's limit)."""


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
    normalize: TrueFlag = True
    """vLLM's: L2-normalize the embeddings (false: the raw hidden state)."""
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
    async def create_embedding(body: EmbeddingCreateRequest, request: Request) -> EmbeddingResponse:
        """Each input's embedding (last-token pooling), in input order."""
        embedder = frontend.embedder
        if embedder is None:
            raise GatewayError(ErrorKind.NOT_FOUND, "this server does not serve embeddings")
        check_model(body.model, frontend)
        request_id = _request_id(request)
        arrival: float = request.state.arrival
        deadline = (
            None if frontend.request_timeout_s is None else arrival + frontend.request_timeout_s
        )
        keep = frontend.limits.prompt_tokens_kept(
            body.truncate_prompt_tokens, "truncate_prompt_tokens"
        )
        try:
            pooling = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
        except SamplingParamError as exc:
            raise invalid(str(exc), param=exc.param) from None
        lora_name = frontend.lora_name(body.model)
        async with admitted(frontend):
            prompts = await asyncio.to_thread(_prompts, body, frontend.tokenizer, keep)
            _check_lengths(prompts, frontend.limits.max_model_len)
            num_tokens = sum(map(len, prompts))
            lease = current_lease()
            if lease is not None:
                lease.add_tokens(num_tokens)
            frontend.metrics.prompt_tokens.inc(num_tokens)
            requests = [
                EmbeddingRequest(
                    request_id=f"{request_id}-{index}" if len(prompts) > 1 else request_id,
                    prompt_token_ids=prompt,
                    pooling=pooling,
                    priority=body.priority,
                    lora_name=lora_name,
                    deadline=deadline,
                )
                for index, prompt in enumerate(prompts)
            ]
            try:
                async with asyncio.timeout_at(_loop_time(deadline)):
                    async with asyncio.TaskGroup() as group:
                        tasks = [group.create_task(embedder.embed(r)) for r in requests]
            except TimeoutError:
                raise GatewayError(
                    ErrorKind.DEADLINE_EXCEEDED, "the request deadline passed"
                ) from None
            except ExceptionGroup as group_error:  # the first failure is the answer
                raise group_error.exceptions[0] from None
        return EmbeddingResponse(
            id=f"embd-{request_id}",
            created=int(time.time()),
            model=frontend.response_model(body.model),
            data=[
                EmbeddingData(index=index, embedding=_encoded(task.result().vector, body))
                for index, task in enumerate(tasks)
            ],
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    return router


def _request_id(request: Request) -> str:
    request_id = request.headers.get("x-request-id")
    if request_id is None:
        return uuid.uuid4().hex
    if not CLIENT_REQUEST_ID.fullmatch(request_id):
        raise invalid("X-Request-Id must be 1 to 128 characters of [A-Za-z0-9._:-]")
    return request_id


def _prompts(
    body: EmbeddingCreateRequest, tokenizer: Tokenizer, keep: int | None
) -> list[tuple[int, ...]]:
    """Each input's token ids (left-truncated to ``keep``), checked against the vocabulary."""
    given = body.input
    if isinstance(given, str):
        prompts = [tokenizer.encode(given, body.add_special_tokens)]
    elif isinstance(given[0], str):
        prompts = [tokenizer.encode(text, body.add_special_tokens) for text in given]
    elif isinstance(given[0], int):
        prompts = [list(given)]
    else:
        prompts = [list(ids) for ids in given]
    if keep is not None:
        prompts = [ids[-keep:] for ids in prompts]
    for index, ids in enumerate(prompts):
        where = "input" if len(prompts) == 1 else f"input[{index}]"
        if not ids:
            raise invalid(f"{where} has no tokens", param="input")
        out_of_vocab = next((t for t in ids if t >= tokenizer.vocab_size), None)
        if out_of_vocab is not None:
            raise invalid(
                f"{where} has token id {out_of_vocab}, outside the vocabulary "
                f"[0, {tokenizer.vocab_size})",
                param="input",
            )
    return [tuple(ids) for ids in prompts]


def _check_lengths(prompts: list[tuple[int, ...]], max_model_len: int) -> None:
    for index, ids in enumerate(prompts):
        if len(ids) > max_model_len:
            where = "input" if len(prompts) == 1 else f"input[{index}]"
            raise invalid(
                f"{where} has {len(ids)} tokens; this model's maximum context length is "
                f"{max_model_len} (truncate_prompt_tokens keeps the last ones)",
                param="input",
            )


def _encoded(vector: list[float], body: EmbeddingCreateRequest) -> list[float] | str:
    if body.encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _loop_time(deadline: float | None) -> float | None:
    """``deadline`` (``time.monotonic()``) on the event loop's clock, for ``timeout_at``."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
