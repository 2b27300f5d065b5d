"""vLLM's chat extensions on the OpenAI bridge, over a scripted generator: the tool-calling loop
as the ``openai`` SDK replays it (tiny model's template, SmolLM2's, and one that iterates the
arguments), ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``,
chat ``echo`` and ``stream_options.continuous_usage_stats``. Each asserts the prompt the nodes
got or the body the client got."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.text.tokenizer import Tokenizer
from support.openai_app import MODEL, OUTPUT_TEXT, Served, assert_error, output_script, sse_chunks
from support.openai_app import start as start_app

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
# Iterates each call's arguments as a mapping, as tool-use templates do.
ITEMS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}{{ call.function.name }}("
    "{% for key, value in call.function.arguments|items %}{{ key }}={{ value }};{% endfor %})"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture
def start() -> Iterator[Any]:
    servers = []

    def make(tokenizer: Tokenizer, text: str = OUTPUT_TEXT, **limits: Any) -> Served:
        served, server = start_app(
            tokenizer, output_script(tokenizer, text), **{"max_model_len": 1024, **limits}
        )
        servers.append(server)
        return served

    yield make
    for server in servers:
        server.stop()


def _with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tokenizer.backend, tokenizer.special_tokens, tokenizer.eos_token_ids, template)


def _prompt(served: Served, index: int = -1) -> str:
    ids = served.generator.requests[index].prompt_token_ids
    return served.tokenizer.decode(ids, skip_special_tokens=False)


# --- the tool-calling loop ---------------------------------------------------------------------


@pytest.mark.parametrize("template", ["tiny", "smollm2", "items"])
def test_a_tool_round_trip_through_the_sdk(
    template: str, tokenizer: Tokenizer, request: pytest.FixtureRequest, start: Any
) -> None:
    if template == "smollm2":
        smollm2_gguf: Path = request.getfixturevalue("smollm2_gguf")
        tokenizer = Tokenizer.from_model_dir(smollm2_gguf)  # as the gateway loads it
    elif template == "items":
        tokenizer = _with_template(tokenizer, ITEMS_TEMPLATE)
    served = start(tokenizer, CALL_TEXT)
    client = served.client()
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert first.choices[0].finish_reason == "tool_calls"
    message = first.choices[0].message
    assert message.content is None
    (call,) = message.tool_calls or ()
    assert json.loads(call.function.arguments) == {"city": "Oslo"}

    # The SDK's replay: the response's message object (content null, arguments as JSON text),
    # then the tool's result.
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "3 degrees"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert second.choices[0].message.tool_calls  # the script calls the tool again
    assert len(served.generator.requests) == 2
    prompt = _prompt(served)
    # The user's turn, the assistant's with empty content, the tool's result, a new turn.
    turns = "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    if template == "items":
        turns += "get_weather(city=Oslo;)"  # the arguments reached the template as a mapping
    turns += "<|im_end|>\n<|im_start|>tool\n3 degrees<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.endswith(turns), prompt


# --- add_generation_prompt, continue_final_message, echo ------------------------------------


def test_add_generation_prompt_false_answers_in_the_last_role(
    tokenizer: Tokenizer, start: Any
) -> None:
    served = start(tokenizer)
    messages = [{"role": "user", "content": "Once upon a"}]
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": False}
    response = served.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert _prompt(served).endswith("<|im_start|>user\nOnce upon a<|im_end|>\n")
    ids = served.generator.requests[-1].prompt_token_ids
    assert ids == tuple(tokenizer.encode_chat(messages, add_generation_prompt=False))
    message = response.json()["choices"][0]["message"]
    assert message == {"role": "user", "content": OUTPUT_TEXT}  # vLLM's role rule
    # The default (true) opens an assistant turn.
    served.post("/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert _prompt(served).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_continue_final_message_and_echo(tokenizer: Tokenizer, start: Any) -> None:
    served = start(tokenizer)
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "The answer is"},
    ]
    body = {
        "model": MODEL,
        "messages": messages,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    whole = served.post("/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    # No end of turn after the final message: the model writes on in it.
    assert _prompt(served).endswith("<|im_start|>assistant\nThe answer is")
    assert whole.json()["choices"][0]["message"] == {"role": "assistant", "content": OUTPUT_TEXT}

    echoed = served.post("/v1/chat/completions", {**body, "echo": True, "n": 2}).json()
    for choice in echoed["choices"]:
        assert choice["message"]["content"] == "The answer is" + OUTPUT_TEXT
    chunks = sse_chunks(served.post("/v1/chat/completions", {**body, "echo": True, "stream": True}))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["choices"][0]["delta"]["content"].startswith("The answer is")
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == "The answer is" + OUTPUT_TEXT

    # echo echoes only a last message of the response's role: not the user's question when
    # the generation prompt opens an assistant turn, the user's text when it does not.
    plain = {"model": MODEL, "messages": messages[:1], "echo": True}
    content = served.post("/v1/chat/completions", plain).json()["choices"][0]["message"]
    assert content == {"role": "assistant", "content": OUTPUT_TEXT}
    as_user = {**plain, "add_generation_prompt": False}
    message = served.post("/v1/chat/completions", as_user).json()["choices"][0]["message"]
    assert message == {"role": "user", "content": "What is 2+2?" + OUTPUT_TEXT}


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # the default is true
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_special_tokens": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_template_control_refusals(
    tokenizer: Tokenizer, start: Any, changes: dict[str, Any], param: str
) -> None:
    served = start(tokenizer)
    body = {"model": MODEL, "messages": [{"role": "assistant", "content": "x"}], **changes}
    error = assert_error(served.post("/v1/chat/completions", body), 400, param)
    assert not served.generator.requests
    if param == "chat_template_kwargs" and isinstance(changes[param], dict):
        assert repr(next(iter(changes[param]))) in error["message"]


def test_add_special_tokens_on_both_routes(tokenizer: Tokenizer, start: Any) -> None:
    """vLLM's defaults: completions add the BOS, chat leaves it to the template."""
    served = start(tokenizer)
    bos = tokenizer.encode("x")[0]
    assert tokenizer.encode("x", add_special_tokens=False)[0] != bos  # else nothing is tested
    prompts = []
    for body in ({"prompt": "x"}, {"prompt": ["x"], "add_special_tokens": False}):
        assert served.post("/v1/completions", {"model": MODEL, **body}).status_code == 200
        prompts.append(served.generator.requests[-1].prompt_token_ids)
    assert list(prompts[0]) == tokenizer.encode("x")
    assert list(prompts[1]) == tokenizer.encode("x", add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    for extra in ({}, {"add_special_tokens": True}):
        body = {"model": MODEL, "messages": messages, **extra}
        assert served.post("/v1/chat/completions", body).status_code == 200
        prompts.append(served.generator.requests[-1].prompt_token_ids)
    assert list(prompts[2]) == tokenizer.encode_chat(messages)
    assert list(prompts[3]) == [bos, *prompts[2]]  # on top of the template's own


def test_chat_template_kwargs_reach_the_template(tokenizer: Tokenizer, start: Any) -> None:
    served = start(_with_template(tokenizer, THINKING_TEMPLATE))
    messages = [{"role": "user", "content": "hi"}]
    # Names the template does not read are ignored (vLLM drops them), "self" included.
    kwargs = {"enable_thinking": False, "self": 1, "unused": {"a": [1]}}
    body = {"model": MODEL, "messages": messages, "chat_template_kwargs": kwargs}
    assert served.post("/v1/chat/completions", body).status_code == 200
    assert _prompt(served) == "user: hi\n/no_think\nassistant:"
    thinking = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    assert served.post("/v1/chat/completions", thinking).status_code == 200
    assert _prompt(served) == "user: hi\nassistant:"


# --- stream_options.continuous_usage_stats ------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_put_usage_on_every_chunk(
    tokenizer: Tokenizer, start: Any, path: str
) -> None:
    served = start(tokenizer)
    prompt = {"messages": [{"role": "user", "content": "Hi"}]}
    if path == "/v1/completions":
        prompt = {"prompt": "Hi", "max_tokens": 50}
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "n": 2, "stream": True, "stream_options": options, **prompt}
    chunks = sse_chunks(served.post(path, body))
    num_prompt = len(served.generator.requests[0].prompt_token_ids)
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * len(
        tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)
    )
    counts: dict[int, list[int]] = {0: [], 1: []}
    for chunk in choice_chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == num_prompt
        assert usage["total_tokens"] == num_prompt + usage["completion_tokens"]
        counts[chunk["choices"][0]["index"]].append(usage["completion_tokens"])
    for index, seen in counts.items():
        # One token per chunk (the script's), counted per choice; the finish chunk repeats it.
        assert seen == sorted(seen) and seen[0] == 1, (index, seen)
        assert seen[-1] == last["usage"]["completion_tokens"] // 2
    # Without it, only the last chunk has usage.
    plain = {**body, "stream_options": {"include_usage": True}}
    assert all(c.get("usage") is None for c in sse_chunks(served.post(path, plain))[:-1])
