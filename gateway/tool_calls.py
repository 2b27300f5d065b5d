"""Tool calling for chat completions: the request's ``tools`` / ``tool_choice`` as a
``ToolPlan``, and per choice a ``ToolCallStream`` that turns generated text into OpenAI
``tool_calls`` (whole, or as streamed deltas).

- ``auto``: the tools go into the chat template; the model's own syntax (``tool_parsers``) is
  parsed out of its text. Streaming passes text through until a call's start marker, then
  holds the rest back and sends the parsed calls when the choice finishes.
- ``required``: the grammar engine forces a JSON array of ``{"name", "parameters"}`` objects,
  one per call, each valid against its function's schema; parsed when the choice finishes.
- a named function: the grammar forces that function's arguments; the text *is* the arguments,
  streamed as argument deltas as it comes.
- ``none``: no tools in the template, text only.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.errors import invalid
from gateway.http_api.openai_protocol import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from gateway.tool_parsers import ParsedCall, ToolParser
from services.guided_decoding import GuidedDecoding

logger = logging.getLogger(__name__)

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolMode(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    tools: tuple[dict[str, Any], ...]
    """The request's tools, as the chat template receives them."""
    named: str | None = None
    """The function a named ``tool_choice`` forces."""
    is_parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.mode is ToolMode.NONE else list(self.tools)

    def guided(self) -> GuidedDecoding | None:
        """The grammar that enforces ``required`` or a named function; None otherwise."""
        if self.mode is ToolMode.NAMED:
            return GuidedDecoding.json_schema(self._parameters(self.named))
        if self.mode is not ToolMode.REQUIRED:
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "parameters": self._parameters(tool["function"]["name"]),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.is_parallel:
            schema["maxItems"] = 1
        return GuidedDecoding.json_schema(schema)

    def _parameters(self, name: str | None) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise AssertionError(name)


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan, checked; None when it has no tools. 400s name the field."""
    return plan_tools(body.tools or [], body.tool_choice, body.parallel_tool_calls)


def plan_tools(
    tools: list[dict[str, Any]],
    choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    prefix: str = "",
) -> ToolPlan | None:
    """Tools (OpenAI's ``{"type": "function", "function": {...}}``) and ``tool_choice``, checked
    into a plan; None without tools. Errors name the field, after ``prefix`` (the gRPC API's
    ``chat.``)."""
    choice_param = f"{prefix}tool_choice"
    if not tools:
        if choice not in (None, "none"):
            raise invalid(f"{choice_param} needs tools", param=choice_param)
        return None
    names = set()
    for index, tool in enumerate(tools):
        where = f"{prefix}tools[{index}]"
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise invalid(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise invalid(f"{where}.function.name must match [A-Za-z0-9_-]{{1,64}}", where)
        if name in names:
            raise invalid(f"{where}.function.name {name!r} is used twice", where)
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters must be a JSON schema object", where)
    is_parallel = parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolPlan(ToolMode.AUTO, tuple(tools), is_parallel=is_parallel)
    if choice == "none":
        return ToolPlan(ToolMode.NONE, tuple(tools))
    if choice == "required":
        return ToolPlan(ToolMode.REQUIRED, tuple(tools), is_parallel=is_parallel)
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid(
                f"{choice_param} must be none, auto, required or "
                "{'type': 'function', 'function': {'name': ...}}",
                param=choice_param,
            )
        if name not in names:
            raise invalid(f"{choice_param} names {name!r}, which is not in tools", choice_param)
        return ToolPlan(ToolMode.NAMED, tuple(tools), named=name)
    raise invalid(f"{choice_param} {choice!r} is not none, auto or required", choice_param)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One choice's text → content and tool calls.

    Life cycle: ``feed`` each text delta (returns the content to send now and the call deltas
    ready), then ``finish`` once (the held-back rest). ``calls`` holds every call sent.
    """

    def __init__(self, plan: ToolPlan, parser: ToolParser) -> None:
        self._plan = plan
        self._parser = parser
        self._text = ""
        self._num_sent = 0
        """Characters of ``_text`` already sent as content."""
        self._call_start: int | None = None
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str | None, list[ToolCallDelta]]:
        self._text += text
        mode = self._plan.mode
        if mode is ToolMode.NAMED:
            return None, self._named_delta(text)
        if mode is ToolMode.REQUIRED:
            return None, []
        if mode is ToolMode.NONE:
            return self._send_content(len(self._text)), []
        if self._call_start is None:
            self._call_start = self._parser.find_start(self._text)
        if self._call_start is not None:
            return self._send_content(self._call_start), []
        return self._send_content(len(self._text) - self._held_suffix()), []

    def finish(self) -> tuple[str | None, list[ToolCallDelta]]:
        mode = self._plan.mode
        if mode is ToolMode.NAMED:
            return None, []
        if mode is ToolMode.REQUIRED:
            calls = _required_calls(self._text)
        elif mode is ToolMode.AUTO and self._call_start is not None:
            calls = list(self._parser.parse(self._text).calls)
        else:
            calls = []
        if not calls:  # no valid call (e.g. cut by max_tokens): the text is what there is
            return self._send_content(len(self._text)), []
        if not self._plan.is_parallel:
            calls = calls[:1]
        deltas = []
        for call in calls:
            deltas.append(self._new_call(call.name, call.arguments))
        return None, deltas

    def result(self) -> tuple[str | None, list[ToolCall] | None]:
        """After ``finish``: the whole message's content and calls (non-streaming responses)."""
        if not self.calls:
            return self._text, None
        content = None
        if self._plan.mode is ToolMode.AUTO and self._call_start:
            content = self._text[: self._call_start] or None
        return content, self.calls

    @property
    def is_named(self) -> bool:
        return self._plan.mode is ToolMode.NAMED

    def _named_delta(self, text: str) -> list[ToolCallDelta]:
        if not self.calls:
            return [self._new_call(self._plan.named or "", text)]
        self.calls[0].function.arguments += text
        return [ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))]

    def _new_call(self, name: str, arguments: str) -> ToolCallDelta:
        call = ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=arguments))
        self.calls.append(call)
        return ToolCallDelta(
            index=len(self.calls) - 1,
            id=call.id,
            type="function",
            function=FunctionCallDelta(name=name, arguments=arguments),
        )

    def _send_content(self, end: int) -> str | None:
        if end <= self._num_sent:
            return None
        text = self._text[self._num_sent : end]
        self._num_sent = end
        return text

    def _held_suffix(self) -> int:
        """Length of the longest end of the text that may be the start of a call's marker."""
        held = 0
        for marker in self._parser.start_markers:
            for k in range(min(len(marker) - 1, len(self._text)), held, -1):
                if marker.startswith(self._text[-k:]):
                    held = k
                    break
        return held


def _required_calls(text: str) -> list[ParsedCall]:
    try:
        values = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(values, list):
        return []
    calls = []
    for value in values:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return []
        arguments = value.get("parameters", {})
        calls.append(ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls
