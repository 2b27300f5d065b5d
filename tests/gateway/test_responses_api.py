"""OpenAI's Responses API (``POST /v1/responses``) through the ``openai`` SDK: the prompt the nodes
get is the chat the request means, the response object and the stream of events are what the SDK
parses, and what the server does not do is refused naming the field the client sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.generation import Finished, GenerationRequest, TokenChunk
from gateway.text.tokenizer import Tokenizer
from services.guided_decoding import GuidedKind
from services.types import FinishReason, Usage
from support.openai_app import MODEL, OUTPUT_TEXT, Served, Step, assert_error, start


@pytest.fixture(scope="module")
def served(tokenizer: Tokenizer) -> Iterator[Served]:
    served, server = start(tokenizer)  # max_model_len 256, max_tokens limit 100
    yield served
    server.stop()


def output_text(tokenizer: Tokenizer, num_tokens: int) -> str:
    return tokenizer.decode(tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:num_tokens])


def test_a_response_is_the_chat_it_means(served: Served) -> None:
    response = served.client().responses.create(
        model=MODEL, input="What is 2+2?", instructions="Be brief.", max_output_tokens=5
    )
    request = served.generator.requests[-1]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"}]  # fmt: skip
    assert list(request.prompt_token_ids) == served.tokenizer.encode_chat(messages)
    assert request.sampling.max_tokens == 5
    assert response.id.startswith("resp") and response.object == "response"
    assert response.output_text == output_text(served.tokenizer, 5)
    # Cut at max_output_tokens: incomplete, and said why.
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.input_tokens == len(request.prompt_token_ids)
    assert response.usage.output_tokens == 5
    assert response.usage.total_tokens == response.usage.input_tokens + 5
    assert response.instructions == "Be brief." and response.max_output_tokens == 5

    whole = served.client().responses.create(model=MODEL, input="Hi", max_output_tokens=100)
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.output_text == OUTPUT_TEXT


def test_messages_with_text_parts(served: Served) -> None:
    served.client().responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Salut", "annotations": []}]},
            {"role": "user", "content": "And bye?"},
        ],
    )  # fmt: skip
    expected = served.tokenizer.encode_chat(
        [{"role": "developer", "content": "Answer in French."},
         {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Salut"},
         {"role": "user", "content": "And bye?"}]
    )  # fmt: skip
    assert list(served.generator.requests[-1].prompt_token_ids) == expected


def test_the_stream_of_events(served: Served) -> None:
    events = list(
        served.client().responses.create(
            model=MODEL, input="Hi", max_output_tokens=6, stream=True, metadata={"k": "v"}
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens cut it
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = output_text(served.tokenizer, 6)
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.metadata == {"k": "v"}
    assert final.usage is not None and final.usage.output_tokens == 6
    assert events[0].response.status == "in_progress" and not events[0].response.output
    # The raw stream: an event line before each data line, and no [DONE].
    raw = served.post("/v1/responses", {"model": MODEL, "input": "Hi", "stream": True}).text
    assert raw.startswith("event: response.created\ndata: {")
    assert "[DONE]" not in raw and raw.rstrip().endswith("}")
    assert json.loads(raw.rstrip().split("data: ")[-1])["type"] == "response.completed"


def test_text_format_json_schema_constrains_the_output(served: Served) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response = served.client().responses.create(
        model=MODEL,
        input="Give JSON",
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema}},
    )
    guided = served.generator.requests[-1].sampling.guided
    assert guided is not None and guided.kind is GuidedKind.JSON_SCHEMA
    assert json.loads(guided.spec) == schema
    assert response.text.format.type == "json_schema"
    served.client().responses.create(
        model=MODEL, input="Give JSON", text={"format": {"type": "json_object"}}
    )
    guided = served.generator.requests[-1].sampling.guided
    assert guided is not None and guided.kind is GuidedKind.JSON_OBJECT


def test_cache_salt_reaches_the_nodes(served: Served) -> None:
    body = {"model": MODEL, "input": "Hi", "cache_salt": "tenant-a"}
    assert served.post("/v1/responses", body).status_code == 200
    assert served.generator.requests[-1].sampling.cache_salt == "tenant-a"
    assert_error(served.post("/v1/responses", {**body, "cache_salt": ""}), 400, "cache_salt")


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"tools": [{"type": "function", "name": "f"}]}, 400, "tools"),
        ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
        ({"reasoning": {"effort": "low"}}, 400, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, 400, "include"),
        ({"truncation": "auto"}, 400, "truncation"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"max_output_tokens": 101}, 400, "max_output_tokens"),
        ({"input": "word " * 300}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400,
         "input[0].content"),
        ({"input": 5}, 400, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "objekt"}}}}, 400,
         "text.format"),
        ({"model": "other"}, 404, "model"),
        ({"frobnicate": 1}, 400, "frobnicate"),
    ],
)  # fmt: skip
def test_refusals_name_the_clients_field(
    served: Served, change: dict[str, Any], status: int, param: str
) -> None:
    before = len(served.generator.requests)
    body = {"model": MODEL, "input": "Hi", **change}
    assert_error(served.post("/v1/responses", body), status, param)
    assert len(served.generator.requests) == before


def test_a_failed_response_says_whose_fault(tokenizer: Tokenizer) -> None:
    """A generation that fails after tokens: ``response.failed``, its error's code
    ``invalid_prompt`` when the request itself failed (its grammar, while it ran; a 400 when
    not streamed), ``server_error`` when a node did (a 503)."""
    ids = tuple(tokenizer.encode("Hello", add_special_tokens=False))

    def script(request: GenerationRequest) -> list[Step]:
        usage = Usage(len(request.prompt_token_ids), len(ids))
        grammar = request.sampling.max_tokens == 7  # the test's marker for "the grammar failed"
        error = "guided.grammar: failed at token 2" if grammar else "decode died"
        return [
            TokenChunk(ids),
            Finished(FinishReason.ERROR, usage, error=error, invalid_request=grammar),
        ]

    served, server = start(tokenizer, script)
    try:
        cases = (
            (7, "invalid_prompt", 400, "invalid_request_error"),
            (8, "server_error", 503, "service_unavailable"),
        )
        for max_tokens, code, status, error_type in cases:
            body = {"model": MODEL, "input": "Hi", "max_output_tokens": max_tokens}
            assert_error(served.post("/v1/responses", body), status, None)
            events = list(
                served.client().responses.create(
                    model=MODEL, input="Hi", max_output_tokens=max_tokens, stream=True
                )
            )
            failed = next(event for event in events if event.type == "response.failed")
            assert failed.response.status == "failed"
            assert failed.response.error is not None
            assert failed.response.error.code == code
            # Then the Responses API's own error event, which the SDK yields rather than raises.
            assert events[-1].type == "error"
            assert events[-1].code == error_type and "failed" in events[-1].message
    finally:
        server.stop()
