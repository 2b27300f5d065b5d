"""Tool calls on the gateway: each family's parser, and ``tool_choice=auto`` through the
``openai`` SDK against the app with a scripted generator that writes a model's tool-call text
(tools rendered into the chat template; parallel calls; streamed deltas equal the whole
response; text before the call stays content; a marker split across tokens is held back);
and completions with ``echo``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.text.tokenizer import Tokenizer
from gateway.tool_calls import ToolCallStream, ToolMode, ToolPlan
from gateway.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedCall,
    ParsedOutput,
    PythonicToolParser,
    make_parser,
    parser_for,
)
from support.openai_app import MODEL, Served, assert_error, output_script, start

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
HERMES_TEXT = (
    'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
    "</tool_call>"
)
# Renders the tools the way Hermes-style templates do, so the test can see them in the prompt.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>"
    "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "assistant:"
)


def test_hermes_parser() -> None:
    parsed = HermesToolParser().parse(HERMES_TEXT)
    assert parsed.content == "Let me look."
    assert parsed.calls == (
        ParsedCall("get_weather", '{"city": "Oslo"}'),
        ParsedCall("get_weather", '{"city": "Lima"}'),
    )
    assert HermesToolParser().parse("no call here").calls == ()
    broken = "<tool_call>{not json</tool_call>"
    assert HermesToolParser().parse(broken).content == broken  # never a half-parsed call


def test_mistral_parser() -> None:
    text = '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    assert MistralToolParser().parse(text).calls == (
        ParsedCall("a", '{"x": 1}'),
        ParsedCall("b", "{}"),
    )
    newer = '[TOOL_CALLS]a[ARGS]{"x": 2}[TOOL_CALLS]b[ARGS]{}'
    assert MistralToolParser().parse(newer).calls == (
        ParsedCall("a", '{"x": 2}'),
        ParsedCall("b", "{}"),
    )


def test_llama3_json_parser() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    parsed = Llama3JsonToolParser().parse(text)
    assert parsed.calls == (ParsedCall("a", '{"x": 1}'), ParsedCall("b", "{}"))
    # Only an answer that starts with a call is one.
    prose = 'The JSON is {"name": "a", "parameters": {}}'
    assert Llama3JsonToolParser().parse(prose).calls == ()


def test_pythonic_parser() -> None:
    text = """[get_weather(city='Oslo', days=2), get_time(), book(rooms=[{"n": 1, "view": None}],
    ok=True, note="a ] and ) inside", ratio=-0.5)]"""
    assert PythonicToolParser().parse(text) == ParsedOutput(None, (
        ParsedCall("get_weather", '{"city": "Oslo", "days": 2}'),
        ParsedCall("get_time", "{}"),
        ParsedCall(
            "book",
            '{"rooms": [{"n": 1, "view": null}], "ok": true, "note": "a ] and ) inside", '
            '"ratio": -0.5}',
        ),
    ))  # fmt: skip
    # Llama 4 wraps the list in its python markers; leading blanks are allowed.
    wrapped = PythonicToolParser().parse(' <|python_start|>[f(x="é")]<|python_end|>')
    assert wrapped.calls == (ParsedCall("f", '{"x": "é"}'),) and wrapped.content is None
    # Anything but literal keyword arguments of named functions is text, never evaluated.
    for text in (
        "The answer is [1, 2].",  # prose: a list mid-sentence
        "[f(1)]",  # positional
        "[f(x=y)]",  # a name, not a literal
        "[f(x=__import__('os').getcwd())]",
        "[f(**kw)]",
        "[obj.method(a=1)]",
        "[f(a=1)] and more",
        "[f(a=float('nan'))]",
        "[f(a={1, 2})]",  # a set has no JSON
        "[]",
        "[f(a=1",  # cut off
    ):
        assert PythonicToolParser().parse(text) == ParsedOutput(text, ()), text


def test_the_family_is_chosen_by_the_vocabulary() -> None:
    def vocab(*tokens: str):
        return lambda token: 7 if token in tokens else None

    assert isinstance(parser_for(vocab("<tool_call>")), HermesToolParser)
    assert isinstance(parser_for(vocab("[TOOL_CALLS]")), MistralToolParser)
    assert isinstance(parser_for(vocab("<|python_tag|>")), Llama3JsonToolParser)
    assert isinstance(parser_for(vocab()), HermesToolParser)
    # --tool-call-parser names one whatever the vocabulary; unset, the vocabulary decides.
    assert isinstance(make_parser("pythonic", vocab("<tool_call>")), PythonicToolParser)
    assert isinstance(make_parser(None, vocab("[TOOL_CALLS]")), MistralToolParser)


def test_a_marker_split_across_deltas_is_held_back() -> None:
    stream = ToolCallStream(ToolPlan(ToolMode.AUTO, (WEATHER,)), HermesToolParser())
    sent = []
    for piece in ("Hi <to", "ol_", "call>", '{"name": "get_weather", "arguments": {}}'):
        content, deltas = stream.feed(piece)
        assert deltas == []
        sent.append(content)
    assert sent == ["Hi ", None, None, None]
    content, deltas = stream.finish()
    assert content is None and [d.function.name for d in deltas] == ["get_weather"]
    # Text that only looked like a marker's start is sent once it is clear it is not.
    plain = ToolCallStream(ToolPlan(ToolMode.AUTO, (WEATHER,)), HermesToolParser())
    assert plain.feed("a <to")[0] == "a "
    assert plain.feed("p")[0] == "<top"
    assert plain.finish() == (None, [])


@pytest.fixture
def hermes_served(tokenizer: Tokenizer) -> Iterator[Served]:
    templated = Tokenizer(tokenizer.backend, tokenizer.special_tokens, (), TEMPLATE)
    served, server = start(templated, output_script(tokenizer, HERMES_TEXT), max_tokens=200)
    yield served
    server.stop()


def test_auto_tool_calls_through_the_sdk(hermes_served: Served, tokenizer: Tokenizer) -> None:
    client = hermes_served.client()
    options: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        max_tokens=200,
    )
    whole = client.chat.completions.create(**options)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Lima"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    # The tools reached the chat template.
    prompt = tokenizer.decode(hermes_served.generator.requests[0].prompt_token_ids)
    assert prompt.startswith("<tools>get_weather;</tools>")

    content, streamed, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **options):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for part in delta.tool_calls or ():
            call = streamed.setdefault(part.index, {"name": "", "arguments": ""})
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    assert content == "Let me look." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls

    # tool_choice none: no tools in the template, the text is plain content.
    plain = client.chat.completions.create(tool_choice="none", **options)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == HERMES_TEXT
    assert not tokenizer.decode(hermes_served.generator.requests[-1].prompt_token_ids).startswith(
        "<tools>"
    )
    # parallel_tool_calls=false keeps the first call only.
    single = client.chat.completions.create(parallel_tool_calls=False, **options)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_named_parser_reads_pythonic_calls_through_the_sdk(tokenizer: Tokenizer) -> None:
    """``--tool-call-parser pythonic``: a Llama-3.2-style answer becomes tool calls, whole and
    streamed, over HTTP; the vocabulary alone would have chosen Hermes."""
    text = "[get_weather(city='Oslo'), get_weather(city=\"Lima\")]"
    served, server = start(
        tokenizer, output_script(tokenizer, text), max_tokens=200, tool_call_parser="pythonic"
    )
    try:
        client = served.client()
        options: dict[str, Any] = dict(
            model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER]
        )
        choice = client.chat.completions.create(**options).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]
        assert calls == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Lima"})]
        streamed: dict[int, dict[str, str]] = {}
        for chunk in client.chat.completions.create(stream=True, **options):
            assert not chunk.choices[0].delta.content  # the list is held back, not sent as text
            for part in chunk.choices[0].delta.tool_calls or ():
                call = streamed.setdefault(part.index, {"name": "", "arguments": ""})
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls
    finally:
        server.stop()


def test_echo_starts_each_completion_with_its_prompt(tokenizer: Tokenizer) -> None:
    served, server = start(tokenizer)
    try:
        client = served.client()
        whole = client.completions.create(model=MODEL, prompt=["Once", "Twice"], echo=True, n=2)
        plain = client.completions.create(model=MODEL, prompt="Once")
        texts = [c.text for c in whole.choices]
        assert texts[0] == texts[1] == "Once" + plain.choices[0].text
        assert texts[2].startswith("Twice") and texts[2] != "Twice"
        streamed = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(
                model=MODEL, prompt="Once", echo=True, stream=True
            )
            if chunk.choices
        )
        assert streamed == texts[0]
        ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], echo=True)
        assert ids.choices[0].text.startswith(tokenizer.decode([5, 6, 7]))
    finally:
        server.stop()


RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def test_function_tools_through_the_responses_api(
    hermes_served: Served, tokenizer: Tokenizer
) -> None:
    """OpenAI's Responses API with function tools (as the Agents SDK calls it): the calls come
    out as ``function_call`` items after the message, whole and streamed alike; the client's
    ``function_call_output`` goes back as the tool's turn, and ``previous_response_id`` carries
    the calls over."""
    client = hermes_served.client()
    whole = client.responses.create(
        model=MODEL, input="Weather?", tools=[RESPONSES_WEATHER], max_output_tokens=200
    )
    assert whole.status == "completed"
    kinds = [item.type for item in whole.output]
    assert kinds == ["message", "function_call", "function_call"]
    assert whole.output_text == "Let me look."
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Lima"}),
    ]
    assert len({c.call_id for c in calls}) == 2 and len({c.id for c in calls}) == 2
    assert whole.tools[0].name == "get_weather" and whole.tool_choice == "auto"
    prompt = tokenizer.decode(hermes_served.generator.requests[-1].prompt_token_ids)
    assert prompt.startswith("<tools>get_weather;</tools>")

    events = list(
        client.responses.create(
            model=MODEL, input="Weather?", tools=[RESPONSES_WEATHER], max_output_tokens=200,
            stream=True,
        )
    )  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me look."  # the calls' markup is never streamed as text
    arguments = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in arguments] == [{"city": "Oslo"}, {"city": "Lima"}]
    final = events[-1]
    assert final.type == "response.completed"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.model_dump() for item in done] == [
        item.model_dump() for item in final.response.output
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))

    # The client runs the tool and answers; the model sees both calls and their outputs.
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=whole.id,
        tools=[RESPONSES_WEATHER],
        tool_choice="none",
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
            {"type": "function_call_output", "call_id": calls[1].call_id, "output": "rain"},
        ],
    )
    assert [item.type for item in follow.output] == ["message"]
    prompt = tokenizer.decode(hermes_served.generator.requests[-1].prompt_token_ids)
    assert not prompt.startswith("<tools>")  # tool_choice none: no tools in the template
    assert "user: Weather?\nassistant: Let me look.\ntool: sunny\ntool: rain\n" in prompt


def test_responses_function_call_items_replayed_as_input(
    hermes_served: Served, tokenizer: Tokenizer
) -> None:
    """Without a stored response, the client sends the calls back itself (the SDK's
    ``to_input_list``): a run of calls joins the assistant turn before it."""
    client = hermes_served.client()
    client.responses.create(
        model=MODEL,
        tools=[RESPONSES_WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        input=[
            {"role": "user", "content": "Weather?"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    )  # fmt: skip
    request = hermes_served.generator.requests[-1]
    assert request.sampling.guided is not None  # the named function's arguments are forced
    expected = hermes_served.tokenizer.encode_chat(
        [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": "Let me look.", "tool_calls": [
             {"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        tools=[WEATHER],
    )  # fmt: skip
    assert list(request.prompt_token_ids) == expected


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ],
)
def test_responses_tool_refusals_name_the_field(
    hermes_served: Served, change: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "Hi", "tools": [RESPONSES_WEATHER], **change}
    assert_error(hermes_served.post("/v1/responses", body), 400, param)
