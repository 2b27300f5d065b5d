"""Llama 3.x JSON tool calls: the whole answer is ``{"name": ..., "parameters": {...}}``, several
separated by ``;``, optionally after ``<|python_tag|>``."""

from __future__ import annotations

import json
import logging

from gateway.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    WholeAnswerToolParser,
    call_from_json,
)

logger = logging.getLogger(__name__)

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(WholeAnswerToolParser):
    name = "llama3_json"
    start_markers = (_PYTHON_TAG, "{")

    def parse(self, text: str) -> ParsedOutput:
        start = self.find_start(text)
        if start is None:
            return ParsedOutput(text, ())
        body = text[start:].removeprefix(_PYTHON_TAG).strip()
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        position = 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ParsedOutput(text, ())
            call = call_from_json(value, arguments_key="parameters")
            if call is None:
                return ParsedOutput(text, ())
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return ParsedOutput(None, tuple(calls))
