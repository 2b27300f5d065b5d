"""Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 templates), or the
newer ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 templates)."""

from __future__ import annotations

import json
import logging

from gateway.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    call_from_json,
    content_or_none,
)

logger = logging.getLogger(__name__)

_MARKER = "[TOOL_CALLS]"
_ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (_MARKER,)

    def parse(self, text: str) -> ParsedOutput:
        start = self.find_start(text)
        if start is None:
            return ParsedOutput(text, ())
        parts = [p.strip() for p in text[start:].split(_MARKER) if p.strip()]
        calls: list[ParsedCall] = []
        for part in parts:
            parsed = _parse_part(part)
            if parsed is None:
                return ParsedOutput(text, ())
            calls.extend(parsed)
        return ParsedOutput(content_or_none(text[:start]), tuple(calls))


def _parse_part(part: str) -> list[ParsedCall] | None:
    if _ARGS in part:
        name, _, arguments = part.partition(_ARGS)
        call = call_from_json({"name": name.strip(), "arguments": arguments.strip()})
        return None if call is None else [call]
    try:
        value = json.loads(part)
    except json.JSONDecodeError:
        return None
    values = value if isinstance(value, list) else [value]
    calls = [call_from_json(v) for v in values]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]
