"""vLLM's score and rerank APIs for an embedding model (a bi-encoder): each text's embedding as
``/v1/embeddings`` computes it (``gateway/embeddings.py``), and a pair's score the cosine
similarity of its two embeddings, as vLLM scores with an embedding model.

    /score, /v1/score     {"model", "text_1": str | [str], "text_2": str | [str],
                           "truncate_prompt_tokens"}: one text_1 against each text_2, or pairs
                          of two lists of one length
                          → {"object": "list", "data": [{"object": "score", "index", "score"}],
                             "usage"}
    /rerank, /v1/rerank, /v2/rerank
                          {"model", "query", "documents": [str], "top_n" (0: all),
                           "truncate_prompt_tokens"} (Jina's and Cohere's shape)
                          → {"results": [{"index", "document": {"text"}, "relevance_score"}],
                             "usage": {"total_tokens"}}, best first

Each distinct text is embedded once, and a text refused (too long) names its field. The key,
its limits and the admission slot are those of an embeddings request; the paths outside
``/v1`` take the key too (``HttpGate``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request, Security
from fastapi.responses import Response
from fastapi.security import HTTPBearer
from pydantic import Field

from gateway.embeddings import MAX_INPUTS, embed_all, embedding_prompts
from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.frontend import Frontend
from gateway.http_api.disconnect import client_gone, unless_disconnected
from gateway.http_api.openai_job import check_model
from gateway.http_api.openai_protocol import NonEmptyText, RequestModel, ResponseModel
from gateway.pipeline import admitted
from services.types import PoolingParams

Texts = NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_INPUTS)]


class ScoreRequest(RequestModel):
    model: str | None = None
    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: int | None = None


class RerankRequest(RequestModel):
    model: str | None = None
    query: NonEmptyText
    documents: Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_INPUTS)]
    top_n: int = Field(0, ge=0)
    """The best ``top_n`` documents only; 0: all of them."""
    truncate_prompt_tokens: int | None = None


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(ResponseModel):
    total_tokens: int


class RerankResponse(ResponseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def score_router(
    frontend: Frontend, bearer: HTTPBearer, errors: dict[int | str, dict[str, object]]
) -> APIRouter:
    router = APIRouter(dependencies=[Security(bearer)])

    async def score(body: ScoreRequest, request: Request) -> ScoreResponse | Response:
        """Cosine similarity of each (text_1, text_2) pair's embeddings."""
        firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise invalid(
                f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
                "or as many as text_2",
                param="text_1",
            )
        request_id = uuid.uuid4().hex
        embedded = await unless_disconnected(request.receive, _embeddings(
            frontend, request, request_id, body.model, {"text_1": firsts, "text_2": seconds},
            body.truncate_prompt_tokens,
        ))  # fmt: skip
        if embedded is None:
            return client_gone(frontend, request_id)
        vectors, tokens = embedded
        scores = await asyncio.to_thread(_cosines, vectors, list(zip(firsts, seconds, strict=True)))
        return ScoreResponse(
            id=f"score-{request_id}",
            created=int(time.time()),
            model=frontend.response_model(body.model),
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens),
        )

    async def rerank(body: RerankRequest, request: Request) -> RerankResponse | Response:
        """The documents by the cosine similarity of their embeddings to the query's."""
        request_id = uuid.uuid4().hex
        fields = {"query": [body.query], "documents": body.documents}
        embedded = await unless_disconnected(request.receive, _embeddings(
            frontend, request, request_id, body.model, fields, body.truncate_prompt_tokens,
        ))  # fmt: skip
        if embedded is None:
            return client_gone(frontend, request_id)
        vectors, tokens = embedded
        pairs = [(body.query, document) for document in body.documents]
        scores = await asyncio.to_thread(_cosines, vectors, pairs)
        ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        return RerankResponse(
            id=f"rerank-{request_id}",
            model=frontend.response_model(body.model),
            usage=RerankUsage(total_tokens=tokens),
            results=[
                RerankResult(
                    index=i,
                    document=RerankDocument(text=body.documents[i]),
                    relevance_score=scores[i],
                )
                for i in ranked[: body.top_n or None]
            ],
        )

    for path in SCORE_PATHS:
        router.add_api_route(path, score, methods=["POST"], response_model=ScoreResponse,
                             responses=errors, name=f"score{path.replace('/', '_')}")  # fmt: skip
    for path in RERANK_PATHS:
        router.add_api_route(path, rerank, methods=["POST"], response_model=RerankResponse,
                             responses=errors, name=f"rerank{path.replace('/', '_')}")  # fmt: skip
    return router


SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


async def _embeddings(
    frontend: Frontend,
    request: Request,
    request_id: str,
    model: str | None,
    fields: dict[str, list[str]],
    truncate_prompt_tokens: int | None,
) -> tuple[dict[str, list[float]], int]:
    """The embedding of each distinct text of ``fields`` (field name → its texts: an error
    names the field), and the prompt tokens embedded."""
    if frontend.embedder is None:
        raise GatewayError(ErrorKind.NOT_FOUND, "this server does not serve embeddings")
    check_model(model, frontend)
    keep = frontend.limits.prompt_tokens_kept(truncate_prompt_tokens, "truncate_prompt_tokens")
    arrival: float = request.state.arrival
    async with admitted(frontend):
        texts: list[str] = []
        prompts: list[tuple[int, ...]] = []
        for param, given in fields.items():
            new = [text for text in dict.fromkeys(given) if text not in texts]
            texts += new
            prompts += await embedding_prompts(
                new, frontend, add_special_tokens=True, keep=keep, param=param
            ) if new else []  # fmt: skip
        embeddings = await embed_all(
            frontend,
            prompts,
            request_id=request_id,
            pooling=PoolingParams(normalize=True),
            priority=0,
            lora_name=frontend.lora_name(model),
            deadline=None
            if frontend.request_timeout_s is None
            else arrival + frontend.request_timeout_s,
        )
    vectors = {text: e.vector for text, e in zip(texts, embeddings, strict=True)}
    return vectors, sum(map(len, prompts))


def _cosines(vectors: dict[str, list[float]], pairs: list[tuple[str, str]]) -> list[float]:
    """Each pair's cosine: the dot product of two normalized vectors. Pure Python (the gateway
    has no numpy), so callers run it in a thread: 2,048 pairs of 4,096 values take seconds."""
    return [sum(x * y for x, y in zip(vectors[a], vectors[b], strict=True)) for a, b in pairs]
