"""Tool-call parsers, one per chat-template family (torch-free, gateway side).

``parser_for(tokenizer_vocab)`` picks the family from the special tokens the vocabulary has:
``<tool_call>`` (Qwen2.5, Hermes), ``[TOOL_CALLS]`` (Mistral), ``<|python_tag|>`` (Llama 3.x);
a vocabulary with none of them gets the Hermes parser, whose markers are plain text. The
gateway's ``--tool-call-parser`` (vLLM's flag) names one instead (``make_parser``): the
``pythonic`` family has no marker token to be found by.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser
from gateway.tool_parsers.hermes import HermesToolParser
from gateway.tool_parsers.llama3_json import Llama3JsonToolParser
from gateway.tool_parsers.mistral import MistralToolParser
from gateway.tool_parsers.pythonic import PythonicToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "mistral": MistralToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
}
_MARKER_TOKENS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
)


def parser_for(token_to_id: Callable[[str], int | None]) -> ToolParser:
    """The parser of the family whose marker token the vocabulary has."""
    for token, name in _MARKER_TOKENS:
        if token_to_id(token) is not None:
            return PARSERS[name]()
    return HermesToolParser()


def make_parser(name: str | None, token_to_id: Callable[[str], int | None]) -> ToolParser:
    """The parser ``name``s (a key of ``PARSERS``), or with None the vocabulary's family."""
    return parser_for(token_to_id) if name is None else PARSERS[name]()


__all__ = [
    "PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedCall",
    "ParsedOutput",
    "PythonicToolParser",
    "ToolParser",
    "make_parser",
    "parser_for",
]
