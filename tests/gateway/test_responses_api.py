"""OpenAI's Responses API (``POST /v1/responses``) through the ``openai`` SDK: the prompt the nodes
get is the chat the request means, the response object and the stream of events are what the SDK
parses, and what the server does not do is refused naming the field the client sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
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


def test_fields_that_change_nothing_here_are_accepted(served: Served) -> None:
    """What SDKs send and this server has no use for: answered as without them."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}
    plain = served.post("/v1/responses", body).json()["output"]
    extras = {"service_tier": "auto", "prompt_cache_key": "user-7", "safety_identifier": "u7",
              "max_tool_calls": 3, "stream_options": {"include_obfuscation": False},
              "background": False}  # fmt: skip
    answered = served.post("/v1/responses", {**body, **extras})
    assert answered.status_code == 200, answered.text
    assert answered.json()["output"][0]["content"] == plain[0]["content"]


def test_cache_salt_reaches_the_nodes(served: Served) -> None:
    body = {"model": MODEL, "input": "Hi", "cache_salt": "tenant-a"}
    assert served.post("/v1/responses", body).status_code == 200
    assert served.generator.requests[-1].sampling.cache_salt == "tenant-a"
    assert_error(served.post("/v1/responses", {**body, "cache_salt": ""}), 400, "cache_salt")


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"tools": [{"type": "file_search"}]}, 400, "tools[0].type"),
        ({"previous_response_id": "resp_1"}, 404, "previous_response_id"),
        ({"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
        ({"reasoning": {"summary": "long"}}, 400, "reasoning.summary"),
        ({"include": ["everything"]}, 400, "include[0]"),
        ({"background": True}, 400, "background"),
        ({"max_tool_calls": 0}, 400, "max_tool_calls"),
        ({"top_logprobs": 2}, 400, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, 400, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"],
          "tools": [{"type": "function", "name": "f"}]}, 400, "include"),
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


def test_previous_response_id_continues_the_stored_conversation(served: Served) -> None:
    """The earlier turns (input and output) come before the new input; the earlier response's
    instructions do not carry over (OpenAI's rule), the new request's own do."""
    client = served.client()
    first = client.responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=4
    )
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, instructions="Be long."
    )
    assert second.previous_response_id == first.id
    expected = [{"role": "system", "content": "Be long."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And then?"}]  # fmt: skip
    assert list(served.generator.requests[-1].prompt_token_ids) == served.tokenizer.encode_chat(
        expected
    )
    # A chain: the third turn sees both earlier ones, streamed turns stored like whole ones.
    third = list(
        client.responses.create(
            model=MODEL, input=[{"role": "user", "content": "Last?"}],
            previous_response_id=second.id, max_output_tokens=3, stream=True,
        )
    )[-1].response  # fmt: skip
    fourth = client.responses.create(model=MODEL, input="Done.", previous_response_id=third.id)
    assert fourth.previous_response_id == third.id
    expected = [expected[1], expected[2],
                {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": second.output_text},
                {"role": "user", "content": "Last?"},
                {"role": "assistant", "content": third.output_text},
                {"role": "user", "content": "Done."}]  # fmt: skip
    assert list(served.generator.requests[-1].prompt_token_ids) == served.tokenizer.encode_chat(
        expected
    )


def test_a_stored_response_is_retrieved_and_deleted(served: Served) -> None:
    import openai

    client = served.client()
    created = client.responses.create(model=MODEL, input="Hi", metadata={"k": "v"})
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    before = len(served.generator.requests)
    body = {"model": MODEL, "input": "x", "previous_response_id": created.id}
    assert_error(served.post("/v1/responses", body), 404, "previous_response_id")
    assert len(served.generator.requests) == before  # refused before any generation


def test_store_false_keeps_a_response_out(served: Served) -> None:
    response = served.client().responses.create(model=MODEL, input="Hi", store=False)
    assert response.store is False
    assert httpx.get(f"{served.url}/v1/responses/{response.id}", timeout=10).status_code == 404


def test_a_response_is_its_api_keys_own(tokenizer: Tokenizer) -> None:
    """Another key (another tenant) is told the response does not exist, and cannot continue
    or delete it."""
    served, server = start(tokenizer, api_keys=("key-a", "key-b"))
    try:
        mine = served.client("key-a").responses.create(model=MODEL, input="Hi")
        theirs = {"Authorization": "Bearer key-b"}
        url = f"{served.url}/v1/responses/{mine.id}"
        assert_error(httpx.get(url, headers=theirs, timeout=10), 404, None)
        assert_error(httpx.delete(url, headers=theirs, timeout=10), 404, None)
        body = {"model": MODEL, "input": "x", "previous_response_id": mine.id}
        assert_error(
            served.post("/v1/responses", body, headers=theirs), 404, "previous_response_id"
        )
        assert served.client("key-a").responses.retrieve(mine.id).id == mine.id
    finally:
        server.stop()


def test_a_gateway_that_stores_nothing_says_so(tokenizer: Tokenizer) -> None:
    served, server = start(tokenizer, responses_store_size=0)
    try:
        response = served.client().responses.create(model=MODEL, input="Hi")
        assert response.store is False
        body = {"model": MODEL, "input": "x", "previous_response_id": response.id}
        assert_error(served.post("/v1/responses", body), 400, "previous_response_id")
    finally:
        server.stop()


def test_a_clients_request_id_never_names_a_stored_response(served: Served) -> None:
    """X-Request-Id stays the request's id on the nodes, but a stored response gets an id of
    the server's: a client naming another's response id cannot replace it."""
    client = served.client()
    original = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    body = {"model": MODEL, "input": "Other", "max_output_tokens": 3}
    reply = served.post("/v1/responses", body, headers={"X-Request-Id": original.id})
    assert reply.status_code == 200
    assert served.generator.requests[-1].request_id == original.id
    assert reply.json()["id"] != original.id
    assert client.responses.retrieve(original.id).output_text == original.output_text
    [message] = reply.json()["output"]
    assert (
        client.responses.retrieve(reply.json()["id"]).output_text == message["content"][0]["text"]
    )


def test_reasoning_effort_reaches_the_chat_template(tokenizer: Tokenizer) -> None:
    """``reasoning.effort`` is the template's ``reasoning_effort`` (gpt-oss's templates read
    it), and the response says which options it ran with."""
    template = (
        "{% if reasoning_effort is defined %}effort={{ reasoning_effort }};{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    templated = Tokenizer(tokenizer.backend, tokenizer.special_tokens, (), template)
    served, server = start(templated)
    try:
        client = served.client()
        response = client.responses.create(
            model=MODEL, input="Hi", reasoning={"effort": "low", "summary": "auto"}
        )
        assert response.reasoning is not None and response.reasoning.effort == "low"
        prompt = tokenizer.decode(served.generator.requests[-1].prompt_token_ids)
        assert prompt.startswith("effort=low;user: Hi")
        client.responses.create(model=MODEL, input="Hi")
        prompt = tokenizer.decode(served.generator.requests[-1].prompt_token_ids)
        assert prompt.startswith("user: Hi")
        # The chat API's own reasoning_effort (OpenAI's), which chat_template_kwargs overrides.
        messages = [{"role": "user", "content": "Hi"}]
        client.chat.completions.create(model=MODEL, messages=messages, reasoning_effort="high")
        prompt = tokenizer.decode(served.generator.requests[-1].prompt_token_ids)
        assert prompt.startswith("effort=high;user: Hi")
        client.chat.completions.create(
            model=MODEL, messages=messages, reasoning_effort="high",
            extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}},
        )  # fmt: skip
        prompt = tokenizer.decode(served.generator.requests[-1].prompt_token_ids)
        assert prompt.startswith("effort=low;user: Hi")
        body = {"model": MODEL, "messages": messages, "reasoning_effort": "max"}
        assert_error(served.post("/v1/chat/completions", body), 400, "reasoning_effort")
    finally:
        server.stop()


def test_output_text_logprobs_when_included(served: Served) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: each output token's
    logprob and alternatives on the text, whole, and streamed with the text deltas alike."""
    client = served.client()
    options: dict[str, Any] = dict(
        model=MODEL, input="Hi", max_output_tokens=5, top_logprobs=2,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    whole = client.responses.create(**options)
    assert served.generator.requests[-1].sampling.logprobs == 2
    part = whole.output[0].content[0]
    assert len(part.logprobs) == 5 and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == whole.output_text
    assert all(lp.logprob == -0.25 for lp in part.logprobs)  # the script's
    events = list(client.responses.create(stream=True, **options))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.model_dump() for lp in streamed] == [lp.model_dump() for lp in part.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done.logprobs] == [lp.model_dump() for lp in part.logprobs]
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=5)
    assert plain.output[0].content[0].logprobs == []
    assert served.generator.requests[-1].sampling.logprobs is None
    # What the Agents SDK asks for when it does not store responses: nothing to add here.
    stateless = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=5, store=False,
        include=["reasoning.encrypted_content"],
    )  # fmt: skip
    assert stateless.output_text == plain.output_text
    assert served.generator.requests[-1].sampling.logprobs is None


def test_the_store_is_on_the_gateways_metrics(tokenizer: Tokenizer) -> None:
    """The store is memory the gateway holds: its responses and characters are gauges."""
    served, server = start(tokenizer)
    try:

        def gauges() -> tuple[float, float]:
            text = httpx.get(f"{served.url}/metrics", timeout=10).text
            values = dict(
                line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("pdserve:resp")
            )
            return (
                float(values["pdserve:responses_stored"]),
                float(values["pdserve:responses_stored_chars"]),
            )

        assert gauges() == (0, 0)
        response = served.client().responses.create(model=MODEL, input="Hi", max_output_tokens=4)
        assert gauges() == (1, len("Hi") + len(response.output_text))
        served.client().responses.delete(response.id)
        assert gauges() == (0, 0)
    finally:
        server.stop()
