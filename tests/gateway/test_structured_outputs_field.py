"""vLLM's ``structured_outputs`` (which replaced its ``guided_*`` fields): each constraint
reaches the nodes as the same grammar the older field gives, and a request that sets none, two,
or an unsupported option is refused naming the field before any node is asked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.text.tokenizer import Tokenizer
from services.guided_decoding import GuidedDecoding, GuidedKind
from support.openai_app import MODEL, Served, assert_error, start

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def served(tokenizer: Tokenizer) -> Iterator[Served]:
    served, server = start(tokenizer)
    yield served
    server.stop()


def sent(served: Served, options: dict[str, Any]) -> GuidedDecoding | None:
    body = {"model": MODEL, "prompt": "x", "structured_outputs": options}
    response = served.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return served.generator.requests[-1].sampling.guided


@pytest.mark.parametrize(
    ("options", "older"),
    [
        ({"json": SCHEMA}, {"guided_json": SCHEMA}),
        ({"json": json.dumps(SCHEMA)}, {"guided_json": SCHEMA}),
        ({"regex": "[a-c]{3}"}, {"guided_regex": "[a-c]{3}"}),
        ({"choice": ["yes", "no"]}, {"guided_choice": ["yes", "no"]}),
        ({"grammar": 'start: "x" | "y"'}, {"guided_grammar": 'start: "x" | "y"'}),
        ({"json": SCHEMA, "disable_any_whitespace": True}, {"guided_json": SCHEMA}),
    ],
)
def test_each_constraint_is_the_older_fields(
    served: Served, options: dict[str, Any], older: dict[str, Any]
) -> None:
    guided = sent(served, options)
    served.post("/v1/completions", {"model": MODEL, "prompt": "x", **older})
    assert guided is not None and guided == served.generator.requests[-1].sampling.guided


def test_json_object_and_closed_objects(served: Served) -> None:
    assert sent(served, {"json_object": True}) == GuidedDecoding(GuidedKind.JSON_OBJECT)
    guided = sent(served, {"json": SCHEMA, "disable_additional_properties": True})
    assert guided is not None and guided.kind is GuidedKind.JSON_SCHEMA
    schema = json.loads(guided.spec)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["b"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["a"]  # not an object schema
    assert "additionalProperties" not in SCHEMA  # the request's own schema is left alone


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[" * 50_000}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": {"type": "objekt"}}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}},
         "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}},
         "structured_outputs.structural_tag"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
         "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "frobnicate": 1}},
         "structured_outputs.frobnicate"),
    ],
)  # fmt: skip
def test_bad_structured_outputs_are_refused(
    served: Served, change: dict[str, Any], param: str
) -> None:
    before = len(served.generator.requests)
    assert_error(
        served.post("/v1/completions", {"model": MODEL, "prompt": "x", **change}), 400, param
    )
    assert len(served.generator.requests) == before
