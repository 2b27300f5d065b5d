"""What a constrained (structured-output) request asks for, and its grammar for llguidance.

One torch-free vocabulary for both sides of the torch line: the gateway builds a
``GuidedDecoding`` from ``response_format``, vLLM's ``guided_*`` fields or a forced tool call, and
checks it here before admission; the nodes receive it in ``SamplingParams.guided`` and compile
the same grammar into a matcher (``services.engine.structured_output``). The grammar engine is
llguidance (``docs/design.md`` says why); only this module and the matcher module import it.
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass

import llguidance

logger = logging.getLogger(__name__)

JSON_WHITESPACE = {"whitespace_flexible": False}
"""Compact JSON (``,`` and ``:`` with no spaces, no newlines): a constrained output cannot pad
itself with whitespace until ``max_tokens``, which a random or weak model otherwise does."""


class GuidedKind(enum.StrEnum):
    JSON_OBJECT = "json_object"
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    JSON_SCHEMA = "json_schema"
    """A JSON value valid against the schema in ``spec``."""
    REGEX = "regex"
    """Text matching the regular expression in ``spec`` (Rust ``regex`` syntax), in full."""
    CHOICE = "choice"
    """Exactly one of the strings of the JSON array in ``spec``."""
    GRAMMAR = "grammar"
    """Text of the Lark grammar in ``spec`` (llguidance's dialect, ``start`` rule first)."""


MAX_CHOICES = 16_384
"""guided.choice entries at most. llguidance's grammars hold fewer than 65,535 symbols: 100,000
choices passed its validation, then failed to compile against the tokenizer after ~16 s (a panic,
on the node). 16,384 compile in 0.18 s on the Intel AMX host."""


@dataclass(frozen=True)
class GuidedDecoding:
    """One request's constraint. Construction checks the shape of ``spec`` (JSON parses, the
    choices are strings); ``check()`` compiles the grammar and reports what llguidance refuses.
    Errors are ``ValueError`` naming the field, ``guided.<kind>``."""

    kind: GuidedKind
    spec: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GuidedKind):
            raise ValueError(f"guided.kind must be one of {[k.value for k in GuidedKind]}")
        if not isinstance(self.spec, str):
            raise ValueError(f"guided.{self.kind} must be a string, got {type(self.spec).__name__}")
        if self.kind is GuidedKind.JSON_OBJECT:
            if self.spec:
                raise ValueError("guided.json_object takes no spec")
        elif not self.spec:
            raise ValueError(f"guided.{self.kind} is empty")
        if self.kind is GuidedKind.JSON_SCHEMA:
            schema = _parse_json(self.spec, self.kind)
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"guided.json_schema must be a JSON object, got {schema!r:.60}")
        elif self.kind is GuidedKind.CHOICE:
            choices = _parse_json(self.spec, self.kind)
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise ValueError("guided.choice must be a non-empty list of non-empty strings")
            if len(choices) > MAX_CHOICES:
                raise ValueError(f"guided.choice has {len(choices)} choices; at most {MAX_CHOICES}")

    @classmethod
    def json_schema(cls, schema: object) -> GuidedDecoding:
        return cls(GuidedKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))

    @classmethod
    def choice(cls, choices: list[str]) -> GuidedDecoding:
        return cls(GuidedKind.CHOICE, json.dumps(choices, ensure_ascii=False))

    @property
    def field_name(self) -> str:
        return f"guided.{self.kind}"

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON form) that this constraint compiles to;
        ``ValueError`` naming the field when llguidance cannot even translate it."""
        try:
            return self._grammar()
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{self.field_name} is invalid: {exc}") from None

    def invalid(self, error: str) -> ValueError:
        """The error for llguidance's refusal ``error``, naming the field."""
        return ValueError(f"{self.field_name} is invalid: {_first_lines(error)}")

    def _grammar(self) -> str:
        matcher = llguidance.LLMatcher
        if self.kind is GuidedKind.JSON_OBJECT:
            return matcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_WHITESPACE)
        if self.kind is GuidedKind.JSON_SCHEMA:
            return matcher.grammar_from_json_schema(self.spec, overrides=JSON_WHITESPACE)
        if self.kind is GuidedKind.REGEX:
            return matcher.grammar_from_regex(self.spec)
        if self.kind is GuidedKind.CHOICE:
            # Lark string literals are JSON strings, so json.dumps quotes any text exactly.
            literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.spec))
            return matcher.grammar_from_lark(f"start: {literals}")
        return matcher.grammar_from_lark(self.spec)

    def check(self) -> None:
        """Raise ``ValueError`` naming the field when llguidance cannot compile the grammar
        (without a tokenizer: the gateway's check before admission)."""
        error = llguidance.LLMatcher.validate_grammar(self.to_grammar())
        if error:
            raise self.invalid(error)


def _parse_json(text: str, kind: GuidedKind) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"guided.{kind} is not valid JSON: {exc}") from None


def _first_lines(message: str, max_chars: int = 300) -> str:
    """llguidance's messages carry a grammar dump after the error; the client needs the error."""
    text = " ".join(line.strip() for line in message.strip().splitlines()[:3])
    return text[:max_chars]
