"""Structured outputs through the gateway's HTTP API on a GGUF checkpoint (no tokenizer.json, as
the default ``make run`` model): ``response_format`` json_object, ``guided_choice`` and a forced
tool call answer 200 with output their grammar allows (random tiny model: the grammar decides)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from support.inprocess_stack import Stack, run_stack

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


def _requests(stack: Stack) -> None:
    base = f"http://127.0.0.1:{stack.gateway.http_port}/v1"
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    model = stack.gateway.frontend.served_model_name
    stopped = 0
    for seed in range(3):
        response = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            seed=seed,
            max_tokens=40,
            response_format={"type": "json_object"},
        )
        choice = response.choices[0]
        text = choice.message.content or ""
        assert text.startswith("{"), text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
            stopped += 1
    assert stopped, "no json_object response closed its object within max_tokens"

    choices = ["yes", "no", "maybe not"]
    for seed in range(3):
        response = client.chat.completions.create(
            model=model, messages=MESSAGES, seed=seed, extra_body={"guided_choice": choices}
        )
        assert response.choices[0].message.content in choices

    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            tools=[TOOL],
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            seed=3,
        )
        # vLLM's finish reasons: "tool_calls" for required, "stop" for a named function.
        expected = "tool_calls" if tool_choice == "required" else "stop"
        assert response.choices[0].finish_reason == expected, response
        (call,) = response.choices[0].message.tool_calls or ()
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), CITY)


@pytest.mark.slow
def test_structured_outputs_on_a_gguf_model(tiny_gguf_factory) -> None:
    async def body(stack: Stack) -> None:
        await asyncio.to_thread(_requests, stack)
        await stack.wait_all_free()

    run_stack(tiny_gguf_factory("qwen3", "F16"), body, colocated=True)
