"""vLLM's ``StructuredOutputsParams``: a request's constraint in vLLM's words (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``), turned into the ``GuidedDecoding`` the
engine enforces.

One conversion for both callers: the offline ``SamplingParams(structured_outputs=...)`` and the
gateway's ``structured_outputs`` request field, so the two accept and refuse the same things.
Errors are ``SamplingParamError`` naming the field (``structured_outputs.json``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.guided_decoding import GuidedDecoding, GuidedKind
from services.types.sampling_param_error import SamplingParamError

_PARAM = "structured_outputs"
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON schema, as a dict or as JSON text), ``regex``,
    ``choice`` (a list of strings), ``grammar`` (a Lark grammar, llguidance's dialect) or
    ``json_object`` (True: any JSON object). Checked when ``to_guided`` runs (``SamplingParams``
    runs it at construction)."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    """Accepted either way: JSON output here never has whitespace between its tokens."""
    disable_additional_properties: bool = False
    """Objects of the schema that do not say otherwise take no properties beyond theirs."""
    disable_fallback: bool = False
    """Accepted either way: there is one grammar engine (llguidance) and nothing to fall back
    to."""
    whitespace_pattern: str | None = None
    """Unsupported: only None."""
    structural_tag: str | None = None
    """Unsupported: only None."""

    @property
    def field_name(self) -> str:
        """``structured_outputs.<the constraint given>``; ``structured_outputs`` when there is
        not exactly one."""
        named = self._named()
        return f"{_PARAM}.{named[0]}" if len(named) == 1 else _PARAM

    def to_guided(self) -> GuidedDecoding:
        """The constraint as the engine takes it; ``SamplingParamError`` naming the field that is
        wrong."""
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise SamplingParamError(f"{_PARAM}.{name}", f"{_PARAM}.{name} is not supported")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamError(
                    f"{_PARAM}.{name}",
                    f"{_PARAM}.{name} must be a bool, got {getattr(self, name)!r}",
                )
        named = self._named()
        if len(named) != 1:
            raise SamplingParamError(
                _PARAM,
                f"{_PARAM} takes exactly one of json, regex, choice, grammar and json_object, "
                f"got {', '.join(named) or 'none'}",
            )
        where = self.field_name
        if self.json_object is not None:
            if self.json_object is not True:
                raise SamplingParamError(where, f"{where} must be true (or left out)")
            return GuidedDecoding(GuidedKind.JSON_OBJECT)
        try:
            if self.json is not None:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                if self.disable_additional_properties:
                    schema = copy.deepcopy(schema)
                    _close_objects(schema)
                return GuidedDecoding.json_schema(schema)
            if self.choice is not None:
                if isinstance(self.choice, (str, bytes)):
                    raise ValueError("must be a list of strings")
                return GuidedDecoding.choice(list(self.choice))
            kind = GuidedKind.REGEX if self.regex is not None else GuidedKind.GRAMMAR
            return GuidedDecoding(kind, self.regex if self.regex is not None else self.grammar)  # type: ignore[arg-type]
        except (ValueError, TypeError, RecursionError) as exc:
            raise SamplingParamError(where, f"{where}: {exc}") from None

    def _named(self) -> list[str]:
        return [name for name in _CONSTRAINTS if getattr(self, name) is not None]


def _close_objects(schema: object) -> None:
    """In place, as vLLM's ``disable_additional_properties``: every object schema with
    ``properties`` (or ``patternProperties``) and no ``additionalProperties`` gets it false."""
    if isinstance(schema, dict):
        for value in schema.values():
            _close_objects(value)
        if "additionalProperties" not in schema and (
            "properties" in schema or "patternProperties" in schema
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for item in schema:
            _close_objects(item)
