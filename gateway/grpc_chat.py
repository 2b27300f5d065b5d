"""The gRPC API's chat input (``pdserve.v1.ChatMessages``) as the chat template and the tool
plan take it: the OpenAI bridge's message dicts, template controls and tools, each checked, a bad
field an INVALID_ARGUMENT naming ``chat.<field>`` (``chat.messages[0].role``). Roles are the ones
the OpenAI bridge takes (``chat_template.ROLES``); what only rendering finds is the template's to
refuse, renamed into the chat by ``in_chat``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import GatewayError, invalid, invalid_from
from gateway.tool_calls import ToolPlan, plan_tools
from pdserve.v1 import gateway_pb2
from services.chat_template import (
    OPENAI_TEMPLATE_FIELDS,
    ROLES,
    ChatRequestError,
    check_template_kwargs,
)

# The request's fields for the template variables chat_template_kwargs may not set: the
# OpenAI bridge's, inside ChatMessages.
_OWN_TEMPLATE_FIELDS = {
    name: f"chat.{field}"
    for name, field in OPENAI_TEMPLATE_FIELDS.items()
    if name != "add_special_tokens"  # the bridge's alone: the gRPC chat has no such field
}


@dataclass(frozen=True)
class ChatInput:
    """``ChatMessages`` as the chat template takes them (``Tokenizer.encode_chat``)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: ToolPlan | None = None
    """The request's tools and how they may be called; None without tools."""


def chat_input(chat: gateway_pb2.ChatMessages) -> ChatInput:
    """The chat fields checked (INVALID_ARGUMENT naming the field) and turned into the OpenAI
    message dicts the template renders."""
    if not chat.messages:
        raise invalid("chat.messages must be a non-empty list", param="chat.messages")
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(chat.messages):
        where = f"chat.messages[{index}]"
        if message.role not in ROLES:
            param = f"{where}.role"
            raise invalid(f"{param}: {message.role!r} is not one of {', '.join(ROLES)}", param)
        fields: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.name:
            fields["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise invalid(
                    f"{where}.tool_calls: only an assistant turn makes tool calls",
                    param=f"{where}.tool_calls",
                )
            calls = []
            for call_index, call in enumerate(message.tool_calls):
                if not call.name:
                    param = f"{where}.tool_calls[{call_index}].name"
                    raise invalid(f"{param}: a call names its function", param=param)
                function = {"name": call.name, "arguments": call.arguments}
                calls.append({"id": call.id, "type": "function", "function": function})
            fields["tool_calls"] = calls
        if message.role == "tool":
            if not message.tool_call_id:
                # As on the OpenAI bridge: templates that render tool results read the id.
                param = f"{where}.tool_call_id"
                raise invalid(f"{param}: a tool message needs the id of the call it answers", param)
            fields["tool_call_id"] = message.tool_call_id
        elif message.tool_call_id:
            param = f"{where}.tool_call_id"
            raise invalid(f"{param}: only a tool message answers a call", param=param)
        messages.append(fields)
    add_generation_prompt = (
        chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    )
    if chat.continue_final_message and add_generation_prompt:
        # The template's refusal too; here before admission, naming this request's fields.
        raise invalid(
            "chat.continue_final_message needs chat.add_generation_prompt: false (the model "
            "continues the last message instead of starting a new turn)",
            param="chat.continue_final_message",
        )
    return ChatInput(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        template_kwargs=_template_kwargs(chat.chat_template_kwargs),
        tools=_tool_plan(chat),
    )


def _tool_plan(chat: gateway_pb2.ChatMessages) -> ToolPlan | None:
    """``tools`` and ``tool_choice`` as the OpenAI bridge's, checked (``plan_tools``)."""
    tools = []
    for index, tool in enumerate(chat.tools):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            param = f"chat.tools[{index}].parameters"
            try:
                function["parameters"] = json.loads(tool.parameters)
            except (ValueError, RecursionError) as exc:
                raise invalid(f"{param} is not valid JSON: {exc}", param=param) from None
        tools.append({"type": "function", "function": function})
    choice: str | dict[str, Any] | None = chat.tool_choice or None
    if choice not in (None, "auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None
    return plan_tools(tools, choice, parallel, prefix="chat.")


def _template_kwargs(text: str) -> dict[str, Any]:
    """``chat_template_kwargs``: empty, or a JSON object without the names the gateway sets."""
    param = "chat.chat_template_kwargs"
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
        raise invalid(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(kwargs, dict):
        raise invalid(f"{param} must be a JSON object, got {type(kwargs).__name__}", param=param)
    try:
        check_template_kwargs(kwargs, param, _OWN_TEMPLATE_FIELDS)
    except ChatRequestError as exc:
        raise invalid_from(exc) from None
    return kwargs


def in_chat(error: GatewayError) -> GatewayError:
    """A refusal of the chat template, which names the OpenAI request's fields (``messages``,
    ``continue_final_message``), naming this request's: ``chat.<field>`` as its param, and its
    message starting with that path, as every other refusal of a chat field does."""
    param = error.param
    if param is None or param.startswith("chat."):
        return error
    message = error.message
    field_name = re.match(r"\w+", param)
    if field_name is not None and message.startswith(field_name.group()):
        message = f"chat.{message}"  # "continue_final_message: ..." names its field already
    else:
        message = f"chat.{param}: {message}"
    return GatewayError(
        error.kind, message, f"chat.{param}", retry_after_s=error.retry_after_s, reason=error.reason
    )
