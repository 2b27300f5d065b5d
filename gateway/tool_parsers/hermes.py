"""Qwen2.5 / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
call, possibly after some text."""

from __future__ import annotations

import json
import logging
import re

from gateway.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    call_from_json,
    content_or_none,
)

logger = logging.getLogger(__name__)

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)

    def parse(self, text: str) -> ParsedOutput:
        start = self.find_start(text)
        if start is None:
            return ParsedOutput(text, ())
        calls: list[ParsedCall] = []
        for block in _BLOCK.findall(text[start:]):
            try:
                call = call_from_json(json.loads(block))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedOutput(text, ())
            calls.append(call)
        return ParsedOutput(content_or_none(text[:start]), tuple(calls))
