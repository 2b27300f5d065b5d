"""``response_format`` on ``/v1/completions``, as vLLM's ``CompletionRequest`` takes it: the same
constraint reaches the nodes as from the same field on a chat request, and a bad one is refused
naming the field before any node is asked, as on chat."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.text.tokenizer import Tokenizer
from services.guided_decoding import GuidedDecoding, GuidedKind
from support.openai_app import MODEL, Served, assert_error, start

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": MODEL, "prompt": "x"}


@pytest.fixture(scope="module")
def served(tokenizer: Tokenizer) -> Iterator[Served]:
    served, server = start(tokenizer)
    yield served
    server.stop()


def sent(served: Served, path: str, body: dict[str, Any]) -> GuidedDecoding | None:
    response = served.post(path, body)
    assert response.status_code == 200, response.text
    return served.generator.requests[-1].sampling.guided


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
        {"type": "json_schema", "json_schema": {"name": "thing", "strict": True}},
        {"type": "json_object"},
        {"type": "text"},
    ],
)
def test_response_format_constrains_a_completion_as_it_does_a_chat(
    served: Served, response_format: dict[str, Any]
) -> None:
    body = {"response_format": response_format}
    guided = sent(served, "/v1/completions", {**COMPLETION, **body})
    assert guided == sent(served, "/v1/chat/completions", {**CHAT, **body})
    if response_format["type"] == "text":
        assert guided is None
    elif response_format["type"] == "json_object":
        assert guided == GuidedDecoding(GuidedKind.JSON_OBJECT)
    else:
        schema = response_format["json_schema"].get("schema", {"type": "object"})
        assert guided == GuidedDecoding.json_schema(schema)


def test_a_json_schema_is_the_same_grammar_as_guided_json(served: Served) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    guided = sent(served, "/v1/completions", {**COMPLETION, "response_format": response_format})
    assert guided is not None
    assert guided == sent(served, "/v1/completions", {**COMPLETION, "guided_json": SCHEMA})


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
          "name": "x", "schema": {"type": "objekt"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
         "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs.regex"),
        ({"response_format": "json"}, "response_format"),
    ],
)  # fmt: skip
def test_a_bad_response_format_is_refused_naming_it(
    served: Served, change: dict[str, Any], param: str
) -> None:
    before = len(served.generator.requests)
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        error = assert_error(served.post(path, {**body, **change}), 400, param)
        assert param.split(".")[0] in error["message"], (path, error)
    assert len(served.generator.requests) == before
