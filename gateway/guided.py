"""The constraint an OpenAI request asks for, from ``response_format``, vLLM's
``structured_outputs`` or older ``guided_*`` fields, or a forced tool call, checked before
admission.

At most one source may constrain a request; a grammar llguidance cannot compile, or gives up on
within its first bytes (``GuidedDecoding.check``: a rule of more than 2,000 alternatives, a regex
that outgrows its lexer), is a 400 that names the request's own field (``response_format``,
``guided_regex``, ...), never a node error or a request that runs and fails.
"""

from __future__ import annotations

import logging

from gateway.errors import invalid
from gateway.http_api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StructuredOutputs,
)
from services.guided_decoding import GuidedDecoding, GuidedKind
from services.types import SamplingParamError, StructuredOutputsParams

logger = logging.getLogger(__name__)


def guided_from_request(
    body: CompletionRequest | ChatCompletionRequest,
) -> tuple[GuidedDecoding, str] | None:
    """The request's constraint and the field it came from; None for free text."""
    found: list[tuple[GuidedDecoding, str]] = []
    if body.response_format is not None:  # completions take it too, as vLLM's do
        guided = _from_response_format(body)
        if guided is not None:
            found.append((guided, "response_format"))
    fields = (
        ("guided_json", GuidedKind.JSON_SCHEMA),
        ("guided_regex", GuidedKind.REGEX),
        ("guided_choice", GuidedKind.CHOICE),
        ("guided_grammar", GuidedKind.GRAMMAR),
    )
    for name, kind in fields:
        value = getattr(body, name)
        if value is None:
            continue
        try:
            if kind is GuidedKind.JSON_SCHEMA:
                guided = GuidedDecoding.json_schema(value)
            elif kind is GuidedKind.CHOICE:
                guided = GuidedDecoding.choice(value)
            else:
                guided = GuidedDecoding(kind, value)
        except ValueError as exc:
            raise invalid(f"{name}: {exc}", param=name) from None
        found.append((guided, name))
    if body.structured_outputs is not None:
        found.append(_from_structured_outputs(body.structured_outputs))
    if len(found) > 1:
        names = ", ".join(name for _, name in found)
        raise invalid(f"only one of {names} may constrain a request", param=found[1][1])
    if not found:
        return None
    check(*found[0])
    return found[0]


def check(guided: GuidedDecoding, param: str) -> None:
    """A 400 naming ``param`` when llguidance cannot compile the grammar or run its first bytes
    (a worker thread's time: ~2 s for ``x{1000}{1000}``, which burns llguidance's lexer fuel)."""
    try:
        guided.check()
    except ValueError as exc:
        raise invalid(f"{param}: {exc}", param=param) from None


def _from_response_format(body: CompletionRequest | ChatCompletionRequest) -> GuidedDecoding | None:
    response_format = body.response_format
    assert response_format is not None
    kind = response_format.type
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding(GuidedKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = response_format.json_schema
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise invalid(
                "response_format.json_schema must be an object with a 'schema' object",
                param="response_format.json_schema",
            )
        # OpenAI takes a missing schema as "any JSON object"; strict or not, the grammar holds.
        schema = spec.get("schema", {"type": "object"})
        try:
            return GuidedDecoding.json_schema(schema)
        except ValueError as exc:
            raise invalid(f"response_format: {exc}", param="response_format") from None
    raise invalid(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
        param="response_format.type",
    )


def _from_structured_outputs(options: StructuredOutputs) -> tuple[GuidedDecoding, str]:
    """vLLM's ``structured_outputs``: its one constraint and the field that set it (the
    conversion the offline ``SamplingParams(structured_outputs=...)`` makes too)."""
    params = StructuredOutputsParams(
        json=options.json_spec,
        regex=options.regex,
        choice=options.choice,
        grammar=options.grammar,
        json_object=options.json_object,
        disable_any_whitespace=options.disable_any_whitespace,
        disable_additional_properties=options.disable_additional_properties,
        whitespace_pattern=options.whitespace_pattern,
        structural_tag=options.structural_tag,
    )
    try:
        return params.to_guided(), params.field_name
    except SamplingParamError as exc:
        raise invalid(str(exc), param=exc.param) from None
