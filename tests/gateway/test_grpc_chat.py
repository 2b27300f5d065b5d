"""The gRPC API's chat input: every field of ``ChatMessages`` reaches the chat template as the
OpenAI bridge's field of the same name does (the prompt the node got equals the tokenizer's
rendering of the same conversation), and a bad field is INVALID_ARGUMENT naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import grpc
import pytest

from gateway.errors import ErrorKind, invalid
from gateway.grpc_chat import in_chat
from gateway.http_api.openai_protocol import Role
from pdserve.v1 import common_pb2, gateway_pb2
from services.chat_template import ROLES
from support.fake_gateway import FakeGateway

# Renders every field a message may carry, and one template variable of the client's.
TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}>"
    "{{ m.content }}"
    "{% for call in m.tool_calls or [] %}[{{ call.id }} {{ call.function.name }}"
    "{% for key, value in call.function.arguments|items %} {{ key }}={{ value }}{% endfor %}]"
    "{% endfor %}"
    "{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}</{{ m.role }}>\n"
    "{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with TEMPLATE as its chat template."""
    model = tmp_path_factory.mktemp("templated")
    for item in tiny_llama_dir.iterdir():
        (model / item.name).symlink_to(item)
    (model / "chat_template.jinja").write_text(TEMPLATE)  # wins over tokenizer_config's
    return model


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[FakeGateway]:
    gateway = FakeGateway.start(model)
    yield gateway
    gateway.close()


def _prompt(served: FakeGateway, chat: gateway_pb2.ChatMessages) -> list[int]:
    code, details, _ = served.call(gateway_pb2.GatewayGenerateRequest(chat=chat))
    assert code is grpc.StatusCode.OK, details
    return served.node.prompts[-1]


def _rendered(served: FakeGateway, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    return served.gateway.frontend.tokenizer.encode_chat(messages, **options)


def test_every_message_field_reaches_the_template(served: FakeGateway) -> None:
    chat = gateway_pb2.ChatMessages(
        messages=[
            gateway_pb2.ChatMessage(role="user", content="Weather?", name="ann"),
            gateway_pb2.ChatMessage(
                role="assistant",
                tool_calls=[
                    gateway_pb2.ChatToolCall(id="c1", name="get", arguments='{"city": "Oslo"}')
                ],
            ),
            gateway_pb2.ChatMessage(role="tool", content="12 C", tool_call_id="c1"),
        ]
    )
    expected = _rendered(
        served,
        [
            {"role": "user", "content": "Weather?", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "content": "12 C", "tool_call_id": "c1"},
        ],
    )
    assert _prompt(served, chat) == expected
    text = served.gateway.frontend.tokenizer.decode(expected)
    for piece in ("name=ann", "[c1 get city=Oslo]", "(answers c1)", "<assistant>"):
        assert piece in text, text


def test_template_controls_reach_the_template(served: FakeGateway) -> None:
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi th"}]
    turns = [gateway_pb2.ChatMessage(**m) for m in messages]

    default = _prompt(served, gateway_pb2.ChatMessages(messages=turns))
    assert default == _rendered(served, messages)

    no_prompt = _prompt(
        served, gateway_pb2.ChatMessages(messages=turns, add_generation_prompt=False)
    )
    assert no_prompt == _rendered(served, messages, add_generation_prompt=False)
    assert no_prompt != default

    continued = _prompt(
        served,
        gateway_pb2.ChatMessages(
            messages=turns, add_generation_prompt=False, continue_final_message=True
        ),
    )
    expected = _rendered(served, messages, add_generation_prompt=False, continue_final_message=True)
    assert continued == expected
    assert served.gateway.frontend.tokenizer.decode(continued).endswith("Hi th")

    kwargs = json.dumps({"enable_thinking": False})
    thinking = _prompt(
        served, gateway_pb2.ChatMessages(messages=turns, chat_template_kwargs=kwargs)
    )
    assert thinking == _rendered(served, messages, enable_thinking=False)
    assert "/no_think" in served.gateway.frontend.tokenizer.decode(thinking)


@pytest.mark.parametrize(
    ("chat", "needle"),
    [
        (dict(messages=[dict(role="tool", content="12 C")]), "chat.messages[0].tool_call_id"),
        (
            dict(messages=[dict(role="user", content="hi", tool_call_id="c1")]),
            "chat.messages[0].tool_call_id",
        ),
        (
            dict(messages=[dict(role="user", content="hi", tool_calls=[dict(name="f")])]),
            "chat.messages[0].tool_calls",
        ),
        (
            dict(messages=[dict(role="assistant", tool_calls=[dict(id="c1")])]),
            "chat.messages[0].tool_calls[0].name",
        ),
        (dict(messages=[dict(role="user", content="hi")], chat_template_kwargs="{"), "not valid"),
        (
            dict(messages=[dict(role="user", content="hi")], chat_template_kwargs="[" * 10_000),
            "not valid",
        ),
        (dict(messages=[dict(role="user", content="hi")], chat_template_kwargs="[]"), "object"),
        (
            dict(messages=[dict(role="user", content="hi")], chat_template_kwargs='{"tools": []}'),
            "cannot set 'tools'",
        ),
        (
            dict(
                messages=[dict(role="user", content="hi")],
                chat_template_kwargs='{"add_generation_prompt": false}',
            ),
            "chat.add_generation_prompt",
        ),
        (
            dict(messages=[dict(role="user", content="hi")], continue_final_message=True),
            "chat.continue_final_message needs chat.add_generation_prompt: false",
        ),
        (dict(messages=[]), "chat.messages must be a non-empty list"),
        (
            dict(messages=[dict(role="user", content="hi"), dict(role="bogus", content="x")]),
            "chat.messages[1].role: 'bogus' is not one of system, developer, user, assistant, tool",
        ),
        # OpenAI's deprecated role, refused as the OpenAI bridge refuses it.
        (dict(messages=[dict(role="function", content="x")]), "chat.messages[0].role: 'function'"),
        (dict(messages=[dict(content="x")]), "chat.messages[0].role: '' is not one of"),
        (
            # Found only by rendering (TEMPLATE iterates over the arguments as a mapping).
            dict(
                messages=[
                    dict(role="user", content="hi"),
                    dict(role="assistant", tool_calls=[dict(id="c1", name="f", arguments="[1]")]),
                ]
            ),
            "chat.messages: the chat template rejected the messages: TypeError",
        ),
    ],
)
def test_bad_chat_fields_are_invalid_argument(
    served: FakeGateway, chat: dict[str, Any], needle: str
) -> None:
    before = len(served.node.prompts)
    code, details, _ = served.call(
        gateway_pb2.GatewayGenerateRequest(chat=gateway_pb2.ChatMessages(**chat))
    )
    assert code is grpc.StatusCode.INVALID_ARGUMENT, details
    assert needle in details
    assert details.startswith("chat."), details  # every refusal names the field's full path
    assert len(served.node.prompts) == before  # refused before any node saw it


def test_the_roles_are_the_openai_bridges() -> None:
    """One list: the gRPC chat and the template refuse what the bridge's model refuses."""
    assert get_args(Role) == ROLES


def test_a_template_refusal_is_renamed_into_the_chat() -> None:
    cut = in_chat(invalid("continue_final_message: cannot be continued", "continue_final_message"))
    assert (cut.param, cut.message) == (
        "chat.continue_final_message",
        "chat.continue_final_message: cannot be continued",
    )
    part = in_chat(
        invalid("messages[0].content: a user message needs content", "messages[0].content")
    )
    assert part.message == "chat.messages[0].content: a user message needs content"
    rejected = in_chat(invalid("the chat template rejected the messages: no", "messages"))
    assert rejected.message == "chat.messages: the chat template rejected the messages: no"
    assert rejected.kind is ErrorKind.INVALID_ARGUMENT
    named = invalid("chat.tools[0].name: bad", "chat.tools[0].name")
    assert in_chat(named) is named


WEATHER = gateway_pb2.ChatTool(
    name="get_weather",
    description="The weather in a city",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}),
)
WEATHER_DICT = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [gateway_pb2.ChatMessage(role="user", content="Weather in Oslo?")]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _answer(
    model: Path,
    output: str,
    chat: gateway_pb2.ChatMessages,
    extra: tuple[str, ...] = (),
    **sampling: Any,
):
    """(node prompt, node sampling, text of the deltas, finished) of one chat whose output the
    node scripts; with ``--reasoning-parser`` in ``extra``, the text is (reasoning, content)."""
    served = FakeGateway.start(model, extra=extra)
    try:
        tokenizer = served.gateway.frontend.tokenizer
        served.node.script = tokenizer.encode(output, add_special_tokens=False)
        request = gateway_pb2.GatewayGenerateRequest(
            chat=chat, sampling=common_pb2.SamplingParams(**{"max_tokens": 64, **sampling})
        )
        code, details, responses = served.call(request)
        assert code is grpc.StatusCode.OK, details
        deltas = [r.delta for r in responses if r.WhichOneof("event") == "delta"]
        text: Any = "".join(d.text for d in deltas)
        if "--reasoning-parser" in extra:
            text = ("".join(d.reasoning for d in deltas), text)
        return served.node.prompts[-1], served.node.samplings[-1], text, responses[-1].finished
    finally:
        served.close()


def test_tools_are_rendered_and_the_calls_parsed(model: Path) -> None:
    chat = gateway_pb2.ChatMessages(messages=ASK, tools=[WEATHER])
    prompt, sampling, text, finished = _answer(model, f"Let me look. {CALL}", chat)
    served = FakeGateway.start(model)
    try:
        tokenizer = served.gateway.frontend.tokenizer
        expected = tokenizer.encode_chat([{"role": "user", "content": "Weather in Oslo?"}],
                                         tools=[WEATHER_DICT])  # fmt: skip
    finally:
        served.close()
    assert prompt == expected and "TOOLS: get_weather" in tokenizer.decode(prompt)
    assert not sampling.HasField("guided")  # auto: the model chooses
    assert text.strip() == "Let me look."  # the call's text is not streamed as content
    (call,) = finished.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_")
    # Text without a call comes through whole; tool_choice none renders no tools.
    _, _, text, finished = _answer(model, "No call here.", chat)
    assert text == "No call here." and not finished.tool_calls
    chat.tool_choice = "none"
    prompt, _, text, finished = _answer(model, CALL, chat)
    assert "TOOLS" not in tokenizer.decode(prompt) and text == CALL and not finished.tool_calls


def test_a_named_tool_call_parser_reads_the_calls(model: Path) -> None:
    """``--tool-call-parser pythonic`` on the gRPC API: a Llama-3.2-style list of calls becomes
    the Finished's tool calls, as over HTTP; the vocabulary alone would have chosen Hermes."""
    chat = gateway_pb2.ChatMessages(messages=ASK, tools=[WEATHER])
    pythonic = ("--tool-call-parser", "pythonic")
    answer = "[get_weather(city='Oslo'), get_weather(city=\"Lima\")]"
    _, _, text, finished = _answer(model, answer, chat, pythonic)
    assert text == ""  # the list is held back, not sent as text
    calls = [(c.name, json.loads(c.arguments)) for c in finished.tool_calls]
    assert calls == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Lima"})]
    # Hermes' tags are plain text to the pythonic parser.
    _, _, text, finished = _answer(model, CALL, chat, pythonic)
    assert text == CALL and not finished.tool_calls


def test_a_forced_tool_choice_sends_a_grammar(model: Path) -> None:
    arguments = '{"city": "Oslo"}'
    chat = gateway_pb2.ChatMessages(messages=ASK, tools=[WEATHER], tool_choice="get_weather")
    _, sampling, text, finished = _answer(model, arguments, chat)
    assert sampling.guided.kind == common_pb2.GUIDED_KIND_JSON_SCHEMA
    assert json.loads(sampling.guided.spec)["properties"] == {"city": {"type": "string"}}
    assert text == ""  # the output is the call's arguments
    (call,) = finished.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    chat.tool_choice = "required"
    required = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    _, sampling, text, finished = _answer(model, required, chat)
    assert sampling.guided.kind == common_pb2.GUIDED_KIND_JSON_SCHEMA and text == ""
    assert [c.name for c in finished.tool_calls] == ["get_weather"]


@pytest.mark.parametrize(
    ("chat", "sampling", "needle"),
    [
        (dict(tools=[WEATHER], tool_choice="get_time"), {}, "chat.tool_choice"),
        (dict(tool_choice="required"), {}, "chat.tool_choice"),
        (dict(tools=[gateway_pb2.ChatTool(name="f", parameters="{")]), {}, "chat.tools[0]"),
        (dict(tools=[WEATHER, WEATHER]), {}, "chat.tools[1]"),
        (dict(tools=[gateway_pb2.ChatTool(name="no spaces")]), {}, "chat.tools[0]"),
        (
            dict(tools=[WEATHER], tool_choice="required"),
            dict(guided=common_pb2.GuidedDecoding(kind=common_pb2.GUIDED_KIND_JSON_OBJECT)),
            "sampling.guided",
        ),
    ],
)
def test_bad_tools_are_invalid_argument(
    served: FakeGateway, chat: dict[str, Any], sampling: dict[str, Any], needle: str
) -> None:
    request = gateway_pb2.GatewayGenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=ASK, **chat),
        sampling=common_pb2.SamplingParams(**sampling),
    )
    code, details, _ = served.call(request)
    assert code is grpc.StatusCode.INVALID_ARGUMENT, details
    assert needle in details


def test_reasoning_is_split_off_before_the_calls(model: Path) -> None:
    # The reasoning and the call together are past the fake gateway's 64-token limit.
    qwen3 = ("--reasoning-parser", "qwen3", "--max-tokens-limit", "128")
    chat = gateway_pb2.ChatMessages(messages=ASK, tools=[WEATHER])
    _, _, (reasoning, content), finished = _answer(
        model, f"<think>Use the tool.</think>{CALL}", chat, qwen3, max_tokens=128
    )
    assert reasoning == "Use the tool." and content == ""
    assert [c.name for c in finished.tool_calls] == ["get_weather"]
    plain = gateway_pb2.ChatMessages(messages=ASK)
    _, _, (reasoning, content), _ = _answer(model, "<think>\nHm.\n</think>\n\nOslo.", plain, qwen3)
    assert (reasoning, content) == ("\nHm.\n", "\n\nOslo.")
    # A grammar covers the whole output: nothing is split off.
    guided = common_pb2.GuidedDecoding(kind=common_pb2.GUIDED_KIND_REGEX, spec=".*")
    _, _, (reasoning, content), _ = _answer(model, "<think>x</think>y", plain, qwen3, guided=guided)
    assert (reasoning, content) == ("", "<think>x</think>y")
