"""OpenAI's Responses API (``POST /v1/responses``) as the chat request it means: ``instructions``
a system message, ``input`` the messages, ``max_output_tokens`` the chat's
``max_completion_tokens``, ``text.format`` its ``response_format``, and ``previous_response_id``
the stored conversation it continues, between the instructions and the input (OpenAI does not
carry the earlier response's instructions over). The request then runs as a
chat completion (``openai_job.chat_job``) and is answered by ``responses_format.py``. An error
names the Responses field the client sent (``input``, not ``messages``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from gateway.errors import GatewayError, invalid
from gateway.frontend import Frontend
from gateway.http_api.openai_job import OpenAIJob, chat_job, renamed
from gateway.http_api.openai_protocol import ChatCompletionRequest
from gateway.http_api.response_store import Message
from gateway.http_api.responses_protocol import (
    LOGPROBS_INCLUDE,
    FunctionCallItem,
    FunctionCallOutputItem,
    ReasoningItem,
    ResponsesRequest,
)

# What the chat request calls the fields a Responses request names otherwise (error params).
_PARAM_NAMES = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("messages", "input"),
    # The chat request nests a function's fields under "function": the client's tools do not.
    ("tools", "tools"),
)


def responses_job(
    body: ResponsesRequest,
    request: Request,
    frontend: Frontend,
    history: Sequence[Message] = (),
) -> OpenAIJob:
    """The request checked (what needs no tokenizer) as the chat job it means; ``history``: the
    conversation of the response that ``previous_response_id`` names (``response_store.py``),
    between ``instructions`` and the input."""
    wants_logprobs = LOGPROBS_INCLUDE in (body.include or ())
    if body.top_logprobs is not None and not wants_logprobs:
        raise invalid(
            'top_logprobs needs include: ["message.output_text.logprobs"]', param="top_logprobs"
        )
    if wants_logprobs and (body.tools or frontend.reasoning_parser is not None):
        # The text's tokens are then a part of the output's, which is not told apart by token.
        raise invalid(
            "include message.output_text.logprobs is not supported with tools or with the "
            "server's --reasoning-parser",
            param="include",
        )
    if body.background:
        raise invalid(
            "background responses are not supported: stream the response, or wait for it",
            param="background",
        )
    if body.truncation == "auto":
        raise invalid(
            "truncation 'auto' is not supported: a prompt past the context is refused",
            param="truncation",
        )
    try:
        job = chat_job(_chat_request(body, history), request, frontend, id_prefix="resp")
    except GatewayError as error:
        raise renamed(error, _PARAM_NAMES) from None
    return dataclasses.replace(job, param_names=_PARAM_NAMES)


def input_messages(body: ResponsesRequest) -> list[Message]:
    """The request's ``input`` as chat messages (without ``instructions``): a run of function
    calls joins the assistant turn before it (or makes one), as the chat API holds them, and a
    call's output is a tool message."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[Message] = []
    for item in body.input:
        if isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        elif isinstance(item, ReasoningItem):
            continue  # earlier turns' reasoning stays out of the prompt
        else:
            content: str | list[dict[str, str]] = (
                item.content
                if isinstance(item.content, str)
                else [{"type": "text", "text": part.text} for part in item.content]
            )
            messages.append({"role": item.role, "content": content})
    return messages


def _chat_request(body: ResponsesRequest, history: Sequence[Message]) -> ChatCompletionRequest:
    messages: list[Message] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    messages += [*history, *input_messages(body)]
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "user": body.user,
        "cache_salt": body.cache_salt,
    }
    if LOGPROBS_INCLUDE in (body.include or ()):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.top_logprobs
    if body.reasoning is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if body.tools:
        # The chat API's shape: the function's fields under "function".
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    choice = body.tool_choice
    if choice is not None and body.tools:
        chat["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    elif choice not in (None, "none", "auto"):
        raise invalid("tool_choice: there are no tools to choose", param="tool_choice")
    text_format = None if body.text is None else body.text.format
    if text_format is not None:
        if text_format.type == "json_schema":
            if text_format.schema_ is None:
                raise invalid("text.format: json_schema needs a 'schema'", param="text.format")
            spec = {"name": text_format.name or "response", "schema": text_format.schema_}
            chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        else:
            chat["response_format"] = {"type": text_format.type}
    return ChatCompletionRequest.model_validate(chat)
