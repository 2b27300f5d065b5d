"""Pythonic tool calls (vLLM's ``pythonic`` parser: Llama 3.2 and 4 with their pythonic
templates, ToolACE): the whole answer is a Python list of calls with keyword arguments,
``[get_weather(city="Oslo", days=2), get_time()]``, optionally inside Llama 4's
``<|python_start|>`` ... ``<|python_end|>``.

Parsed with ``ast``, never evaluated: each call must name a function and pass literal keyword
arguments (strings, numbers, booleans, None, and lists, tuples and dicts of them), which become
the call's JSON arguments. Anything else (a positional argument, a name or an expression as a
value, text after the list) leaves the whole answer as content.
"""

from __future__ import annotations

import ast
import json

from gateway.tool_parsers.base import ParsedCall, ParsedOutput, WholeAnswerToolParser

_START, _END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(WholeAnswerToolParser):
    name = "pythonic"
    start_markers = (_START, "[")

    def parse(self, text: str) -> ParsedOutput:
        start = self.find_start(text)
        if start is None:
            return ParsedOutput(text, ())
        body = text[start:].strip().removeprefix(_START).removesuffix(_END).strip()
        calls = _calls(body)
        return ParsedOutput(text, ()) if calls is None else ParsedOutput(None, calls)


def _calls(body: str) -> tuple[ParsedCall, ...] | None:
    """The calls of ``[f(a=1), g()]``; None where ``body`` is anything else."""
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        try:
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):  # a set, bytes, a complex number, a non-finite float
            return None
        calls.append(ParsedCall(node.func.id, text))
    return tuple(calls)
