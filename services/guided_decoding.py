"""What a constrained (structured-output) request asks for, and its grammar for llguidance.

One torch-free vocabulary for both sides of the torch line: the gateway builds a
``GuidedDecoding`` from ``response_format``, vLLM's ``guided_*`` fields or a forced tool call, and
checks it here before admission; the nodes receive it in ``SamplingParams.guided`` and compile
the same grammar into a matcher (``services.engine.structured_output``). The grammar engine is
llguidance (``docs/design.md`` says why); only this module and the matcher module import it.

llguidance refuses some grammars only once it runs them: a rule of more than 2,000 alternatives
(its ``max_items_in_row``) when the rule is first predicted, a regex whose lexer outgrows its
fuel (``x{1000}{1000}``: ~1M fuel, 1-4 s, then "too many expressions constructed") on the first
transition after the first mask. A compile succeeds on both. So each side also drives the grammar
over its first tokens (``probe_error``) before admitting it: the gateway along the first 8 bytes,
with a byte-level vocabulary standing in for the model's, the node along the first token of the
model's own, in its compile pool, where the seconds such a lexer costs stall no engine step. A
failure further along is the engine's to report: the request ends with ``error``.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
from collections.abc import Sequence
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
"""guided.choice entries at most. The choices are one lexeme (``_grammar``): 16,384 short strings
take 157k of llguidance's 1M initial lexer fuel and compile in ~0.15 s (0.24 s with the
gateway's probe) on the 2-core CI host; 100,000 choices passed its validation, then failed to
compile against the tokenizer after ~16 s (a panic, on the node)."""
PROBE_MAX_BYTES = 8
"""How far the gateway's check drives a grammar (``probe_error``), one byte a step: the failures
seen at run time showed on the first byte."""
PROBE_MAX_TOKENS = 1
"""How far a node's compile drives a grammar over the model's vocabulary: the first mask builds
the lexer (the seconds a bad one costs), the first transition shows the failures it left."""


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
            # Lark string literals are JSON strings, so json.dumps quotes any text exactly. One
            # terminal (a lexeme the lexer matches), not a rule: llguidance refuses a rule of more
            # than 2,000 alternatives, and only once the parser predicts it (2,000 choices answered
            # "l" and stopped).
            literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.spec))
            return matcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {literals}")
        return matcher.grammar_from_lark(self.spec)

    def failed(self, error: str) -> str:
        """The message of a request whose grammar llguidance gave up on while it ran."""
        return f"{self.field_name} failed while generating: {_first_lines(error)}"

    def check(self) -> None:
        """Raise ``ValueError`` naming the field when llguidance cannot compile the grammar, or
        gives up on it within its first ``PROBE_MAX_BYTES`` bytes (the gateway's check before
        admission, with no model tokenizer: a byte-level vocabulary stands in)."""
        tokenizer = _byte_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, self.to_grammar(), log_level=0)
        error = matcher.get_error() or probe_error(matcher, PROBE_MAX_BYTES, tokenizer.eos_tokens)
        if error:
            raise self.invalid(error)


def probe_error(
    matcher: llguidance.LLMatcher, max_tokens: int, eos_token_ids: Sequence[int]
) -> str:
    """llguidance's error if it gives up on ``matcher``'s grammar within ``max_tokens`` tokens
    along the lowest allowed token id that is not EOS, else "". Drives a copy: ``matcher`` keeps
    its state, and shares the lexer the copy built (its first mask is then cheap)."""
    probe = matcher.deep_copy()
    for _ in range(max_tokens):
        mask = probe.compute_bitmask()
        if probe.is_error() or probe.is_stopped():
            break
        token_id = _lowest_allowed(mask, eos_token_ids)
        if token_id is None or not probe.consume_token(token_id):
            break
    return probe.get_error()


def _lowest_allowed(mask: bytes, excluded: Sequence[int]) -> int | None:
    """The lowest token id whose bit is set in ``mask`` (bit ``i`` of byte ``i // 8``), other than
    ``excluded``; None when there is none."""
    bits = int.from_bytes(mask, "little")
    for token_id in excluded:
        bits &= ~(1 << token_id)
    return (bits & -bits).bit_length() - 1 if bits else None


class _ByteVocabulary:
    """The 256 bytes and an EOS, as ``llguidance.TokenizerWrapper`` reads a tokenizer: the
    smallest vocabulary that can spell any text, for checking a grammar without the model's."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([value]) for value in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


def _parse_json(text: str, kind: GuidedKind) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"guided.{kind} is not valid JSON: {exc}") from None


def _first_lines(message: str, max_chars: int = 300) -> str:
    """llguidance's messages carry a grammar or parser-state dump after the error; the client
    needs the error."""
    message = message.split("<state>", 1)[0]
    text = " ".join(line.strip() for line in message.strip().splitlines()[:3])
    return text[:max_chars]
