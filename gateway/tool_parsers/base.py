"""What a tool-call parser finds in a model's text, and the interface each family implements."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """The arguments as JSON text (an object)."""


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    """Text outside the tool calls; None when there is none."""
    calls: tuple[ParsedCall, ...]


class ToolParser:
    """One chat-template family's tool-call syntax.

    ``start_markers``: a text that contains one of them from some point on is a tool call from
    there (a streaming choice holds its text back from the first marker). ``parse`` returns the
    calls of a finished text, or the whole text as content when it holds no valid call.
    """

    name = "base"
    start_markers: tuple[str, ...] = ()

    def find_start(self, text: str) -> int | None:
        """Where the first tool call starts in ``text``; None if nowhere."""
        found = [text.find(m) for m in self.start_markers if m in text]
        return min(found) if found else None

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError


class WholeAnswerToolParser(ToolParser):
    """A family whose calls are the whole answer (Llama 3.x JSON, pythonic): a start marker
    counts only at the answer's start, after blanks; one mid-sentence is text."""

    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.start_markers):
            return len(text) - len(stripped)
        return None


def call_from_json(value: object, arguments_key: str = "arguments") -> ParsedCall | None:
    """``{"name": ..., "arguments" | "parameters": {...}}`` as a call; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("parameters", value.get("arguments", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def content_or_none(text: str) -> str | None:
    return text if text.strip() else None
