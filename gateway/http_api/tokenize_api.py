"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the gateway's tokenizer and chat template
as a service, so that a client counts tokens, or sees the exact prompt a chat becomes, as the
server will (no node is involved).

    /tokenize    {"prompt": "text", "add_special_tokens": true}
                 {"messages": [...], "add_generation_prompt": true, "continue_final_message":
                  false, "chat_template_kwargs": {...}, "tools": [...], "add_special_tokens":
                  false}
                 → {"count", "max_model_len", "tokens", "token_strs"}  (token_strs with
                   "return_token_strs": true: the vocabulary's pieces, as vLLM's)
    /detokenize  {"tokens": [ids]} → {"prompt": "text"}

Both take the API key as ``/v1/*`` does (``HttpGate``), and name the served model or none. They
are bounded apart from generation requests (``Frontend.tokenizer_admission``): a few at once, a
queue of ``--max-queued-requests``, then 429 with ``Retry-After``.
Prompts are not checked against ``max_model_len``: ``count`` is what a client compares with it.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Security
from fastapi.security import HTTPBearer
from pydantic import Discriminator, Field, Tag

from gateway.errors import invalid, invalid_from
from gateway.frontend import Frontend
from gateway.http_api.chat_messages import check_chat_messages
from gateway.http_api.openai_job import check_model
from gateway.http_api.openai_protocol import (
    ChatMessage,
    Flag,
    RequestModel,
    ResponseModel,
    Text,
    TokenId,
    TrueFlag,
)
from gateway.tool_calls import plan_tools
from services.chat_template import OPENAI_TEMPLATE_FIELDS, ChatRequestError, check_template_kwargs


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: Text
    add_special_tokens: TrueFlag = True
    """Add the tokenizer's special tokens (BOS), as the completions API does."""
    return_token_strs: Flag = False


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: TrueFlag = True
    continue_final_message: Flag = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    """Rendered into the template, as a chat completion with ``tool_choice`` auto renders them."""
    add_special_tokens: Flag = False
    """The template writes its own BOS; true adds the tokenizer's too (vLLM's default: false)."""
    return_token_strs: Flag = False


def _tokenize_kind(body: Any) -> str:
    """A body with ``messages`` is a chat's, any other a prompt's: one member is validated, so
    an error names that request's field (``messages``, not the prompt's missing ``prompt``).
    The tags are the class names pydantic would put in an error's location anyway; the error
    handler drops a leading one (``openai_errors.py``)."""
    is_chat = isinstance(body, dict) and "messages" in body
    return "TokenizeChatRequest" if is_chat else "TokenizeCompletionRequest"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_kind),
]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(ResponseModel):
    prompt: str


def tokenize_router(frontend: Frontend, bearer: HTTPBearer) -> APIRouter:
    router = APIRouter(dependencies=[Security(bearer)])

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model, frontend)
        async with frontend.tokenizer_admission.admit():
            # In a thread: a long prompt or a heavy template would stall every stream on the
            # loop.
            return await asyncio.to_thread(_tokenize, body, frontend)

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model, frontend)
        vocab = frontend.tokenizer.vocab_size
        for index, token in enumerate(body.tokens):
            if token >= vocab:
                raise invalid(
                    f"tokens[{index}]: {token} is not below the vocabulary size {vocab}",
                    param=f"tokens[{index}]",
                )
        async with frontend.tokenizer_admission.admit():
            text = await asyncio.to_thread(frontend.tokenizer.decode, body.tokens, False)
        return DetokenizeResponse(prompt=text)

    return router


def _tokenize(
    body: TokenizeCompletionRequest | TokenizeChatRequest, frontend: Frontend
) -> TokenizeResponse:
    tokenizer = frontend.tokenizer
    if isinstance(body, TokenizeCompletionRequest):
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        check_chat_messages(body.messages)  # as the chat route checks them
        kwargs = body.chat_template_kwargs or {}
        try:
            check_template_kwargs(kwargs, "chat_template_kwargs", OPENAI_TEMPLATE_FIELDS)
        except ChatRequestError as exc:
            raise invalid_from(exc) from None
        plan_tools(body.tools or [], None, None)  # the chat route's checks of each tool
        tokens = tokenizer.encode_chat(
            [message.model_dump(exclude_none=True) for message in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=body.add_special_tokens,
            **{**kwargs, "tools": body.tools or None},
        )
    token_strs = None
    if body.return_token_strs:
        token_strs = [tokenizer.backend.id_to_token(token) or "" for token in tokens]
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=frontend.limits.max_model_len,
        tokens=tokens,
        token_strs=token_strs,
    )
