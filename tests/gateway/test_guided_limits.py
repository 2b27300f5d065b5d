"""Grammars at llguidance's limits, checked before admission.

llguidance finds some grammars too much only once it runs them: a rule of more than 2,000
alternatives, or a regex whose lexer grows past its fuel (``x{1000}{1000}``). The gateway's check
drives the grammar over its first bytes, so these are a 400 naming the request's field, not a
request that runs for seconds on the nodes and ends in a text its grammar does not describe.
Thousands of choices are not one of them: they are served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.text.tokenizer import Tokenizer
from services.guided_decoding import MAX_CHOICES, GuidedKind
from support.openai_app import MODEL, Served, assert_error, start

WIDE_RULE = "start: " + " | ".join(json.dumps(f"w{i}") for i in range(2_001))
HUGE_REPEAT = "x{1000}{1000}"


@pytest.fixture(scope="module")
def served(tokenizer: Tokenizer) -> Iterator[Served]:
    served, server = start(tokenizer)
    yield served
    server.stop()


@pytest.mark.parametrize(
    ("path", "fields", "param", "message"),
    [
        ("/v1/completions", {"guided_regex": HUGE_REPEAT}, "guided_regex", "too many expressions"),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "string", "pattern": f"^{HUGE_REPEAT}$"},
                    },
                }
            },
            "response_format",
            "too many expressions",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"grammar": WIDE_RULE}},
            "structured_outputs.grammar",
            "max is 2000",
        ),
        ("/v1/completions", {"guided_grammar": WIDE_RULE}, "guided_grammar", "max is 2000"),
    ],
    ids=["regex", "schema-pattern", "structured-grammar", "guided-grammar"],
)
def test_a_grammar_llguidance_gives_up_on_is_a_400_naming_the_field(
    served: Served, path: str, fields: dict[str, Any], param: str, message: str
) -> None:
    num_sent = len(served.generator.requests)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 50, "temperature": 0, **fields}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    error = assert_error(served.post(path, body), 400, param)
    assert message in error["message"]
    assert "<state>" not in error["message"]  # llguidance's parser dump is left out
    assert len(served.generator.requests) == num_sent  # no node was asked


@pytest.mark.parametrize("num_choices", [2_000, 2_500, MAX_CHOICES])
@pytest.mark.parametrize("where", ["guided_choice", "structured_outputs"])
def test_thousands_of_choices_are_admitted(served: Served, num_choices: int, where: str) -> None:
    choices = [f"label{i}" for i in range(num_choices)]
    fields = {"guided_choice": choices}
    if where == "structured_outputs":
        fields = {"structured_outputs": {"choice": choices}}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 30, **fields}
    response = served.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    guided = served.generator.requests[-1].sampling.guided
    assert guided is not None and guided.kind is GuidedKind.CHOICE
    assert json.loads(guided.spec) == choices


def test_one_choice_past_the_limit_is_a_400(served: Served) -> None:
    choices = [f"label{i}" for i in range(MAX_CHOICES + 1)]
    body = {"model": MODEL, "prompt": "hi", "guided_choice": choices}
    error = assert_error(served.post("/v1/completions", body), 400, "guided_choice")
    assert f"at most {MAX_CHOICES}" in error["message"]
