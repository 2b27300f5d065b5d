"""One chat choice's generated text, as it streams, → reasoning, content and tool calls: the
reasoning parser first (``reasoning.py``: the ``<think>`` block), then the tool parser
(``tool_calls.py``) over what follows it. Both APIs use it: the OpenAI bridge's chat chunks and
the gRPC API's chat deltas.

Life cycle: ``feed`` each text delta, ``finish`` once at the end (what either parser held back:
a tail that might have begun a tag or a call's marker, and the calls parsed whole);
``tool_calls`` holds every call made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.http_api.openai_protocol import ToolCall, ToolCallDelta
from gateway.reasoning import ReasoningParser, ReasoningStream
from gateway.tool_calls import ToolCallStream


@dataclass(frozen=True)
class ChatPiece:
    """What to send for one delta (or at the end)."""

    reasoning: str = ""
    content: str | None = None
    """None: nothing (a forced call's arguments are call deltas, not content)."""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallStream | None) -> None:
        self._reasoning = None if reasoning is None else ReasoningStream(reasoning)
        self._tools = tools

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [] if self._tools is None else self._tools.calls

    def feed(self, text: str) -> ChatPiece:
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text)
        if self._tools is None:
            return ChatPiece(reasoning, text)
        content, calls = self._tools.feed(text)
        return ChatPiece(reasoning, content, calls)

    def finish(self) -> ChatPiece:
        reasoning, held = "", ""
        if self._reasoning is not None:
            reasoning, held = self._reasoning.finish()
        if self._tools is None:
            return ChatPiece(reasoning, held)
        fed, fed_calls = self._tools.feed(held) if held else (None, [])
        content, calls = self._tools.finish()
        text = (fed or "") + (content or "")
        return ChatPiece(reasoning, text or None, [*fed_calls, *calls])
