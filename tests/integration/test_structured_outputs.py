"""Structured outputs and tool calls through the ``openai`` SDK against running stacks (random
tiny model: whatever the weights prefer, the grammar decides what is valid).

- 20 generated JSON schemas: every response parses and validates against its schema
  (``jsonschema``, independent of the grammar engine), and stops on its own.
- A tool-call round trip (``required``, then the tool's answer sent back); streamed tool-call
  deltas assemble to the same call as the whole response.
- The public gRPC API carries a guided spec too, and refuses a bad one naming it.
- The same seeded constrained requests give the same text colocated, disaggregated, and
  recomputed by the decode node after a stalled handoff.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.v1 import common_pb2
from support.inprocess_stack import Stack, run_stack

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 4}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


# Schemas whose every valid value fits the token budget (compact JSON, at most 6 tokens per
# character even as \u escapes): objects of at most 3 keys over leaves, arrays of at most 2.
_NAMES = st.text(alphabet="abcxyz", min_size=1, max_size=2)
_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-50, 40).map(lambda low: {"type": "integer", "minimum": low, "maximum": low + 9}),
    st.lists(
        st.sampled_from(["red", "green", "blue", "x y"]), min_size=1, max_size=3, unique=True
    ).map(lambda values: {"enum": values}),
    st.integers(0, 3).map(lambda n: {"type": "string", "maxLength": n}),
)


def _object(values: st.SearchStrategy[dict[str, Any]], max_keys: int) -> st.SearchStrategy:
    def build(properties: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": properties,
            "required": sorted(properties),
            "additionalProperties": False,
        }

    return st.dictionaries(_NAMES, values, min_size=1, max_size=max_keys).map(build)


_VALUES = st.one_of(
    _LEAVES,
    _LEAVES.flatmap(
        lambda item: st.integers(0, 2).map(
            lambda n: {"type": "array", "items": item, "maxItems": n}
        )
    ),
    _object(_LEAVES, 2),
)
SCHEMAS = _object(_VALUES, 3)


def _client(stack: Stack) -> tuple[openai.OpenAI, str]:
    base = f"http://127.0.0.1:{stack.gateway.http_port}/v1"
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    return client, stack.gateway.frontend.served_model_name


def _json_schemas_validate(stack: Stack) -> None:
    client, model = _client(stack)
    validated: list[dict[str, Any]] = []

    @settings(
        max_examples=20,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
        database=None,
    )
    @given(schema=SCHEMAS, seed=st.integers(0, 2**31))
    def check(schema: dict[str, Any], seed: int) -> None:
        response = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "out", "schema": schema, "strict": True},
            },
        )
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
        validated.append(schema)

    check()
    assert len(validated) >= 20 and len({json.dumps(s) for s in validated}) >= 10


def _tool_calls(stack: Stack) -> None:
    client, model = _client(stack)
    tools = [WEATHER, TIME]
    # required: a call to a declared function with valid arguments. (Parallel calls form an
    # unbounded array, which the random model need not close within the budget.)
    first = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=7,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls, message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)

    # The round trip: the calls and their results go back; the model answers in text.
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [c.model_dump() for c in message.tool_calls],
        },
        *(
            {"role": "tool", "tool_call_id": c.id, "content": '{"ok": true}'}
            for c in message.tool_calls
        ),
    ]
    second = client.chat.completions.create(
        model=model, messages=history, tools=tools, tool_choice="none", max_tokens=5
    )
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content

    # Streamed deltas assemble to the same calls as the whole response (same seed).
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        options: dict[str, Any] = dict(
            messages=MESSAGES, tools=tools, tool_choice=choice, seed=11, parallel_tool_calls=False
        )
        whole = client.chat.completions.create(model=model, **options)
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(model=model, stream=True, **options):
            delta = chunk.choices[0].delta
            finish = chunk.choices[0].finish_reason or finish
            for part in delta.tool_calls or ():
                call = calls.setdefault(part.index, {"name": "", "arguments": ""})
                if part.id:
                    call["id"] = part.id
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
        expected = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in whole.choices[0].message.tool_calls
        ]
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls.values()] == (
            expected
        )
        assert all(c["id"].startswith("call_") for c in calls.values())
        assert finish == whole.choices[0].finish_reason
    named = whole.choices[0].message.tool_calls[0]
    assert named.function.name == "get_weather"
    jsonschema.validate(json.loads(named.function.arguments), WEATHER["function"]["parameters"])


async def _public_grpc_api(stack: Stack) -> None:
    regex = common_pb2.GuidedDecoding(kind=common_pb2.GUIDED_KIND_REGEX, spec="[a-c]{5}")
    sampling = common_pb2.SamplingParams(max_tokens=20, temperature=0.0, guided=regex)
    _, text, finished = await stack.generate([5, 6, 7], sampling=sampling)
    assert (
        re.fullmatch("[a-c]{5}", text) and finished.finish_reason == common_pb2.FINISH_REASON_STOP
    )
    bad = common_pb2.GuidedDecoding(kind=common_pb2.GUIDED_KIND_REGEX, spec="[a-")
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stack.generate([5, 6, 7], sampling=common_pb2.SamplingParams(guided=bad))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "guided.regex" in error.value.details()


@pytest.mark.slow
def test_json_schemas_and_tool_calls_on_the_disaggregated_stack(tiny_llama_dir: Path) -> None:
    async def body(stack: Stack) -> None:
        await _public_grpc_api(stack)
        await asyncio.to_thread(_json_schemas_validate, stack)
        await asyncio.to_thread(_tool_calls, stack)
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)


# --- the same output whichever path served it ------------------------------------------------

_SAME_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


def _constrained_outputs(stack: Stack) -> list[str]:
    client, model = _client(stack)
    texts = []
    for seed in (1, 2):
        response = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"schema": _SAME_SCHEMA}},
        )
        texts.append(response.choices[0].message.content)
    completion = client.completions.create(
        model=model,
        prompt="id:",
        seed=3,
        max_tokens=20,
        extra_body={"guided_regex": "[a-f]{4}-[0-9]{2}"},
    )
    texts.append(completion.choices[0].text)
    completion = client.completions.create(  # vLLM's current form of the same constraint
        model=model,
        prompt="id:",
        seed=4,
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[a-f]{4}-[0-9]{2}"}},
    )
    assert re.fullmatch("[a-f]{4}-[0-9]{2}", completion.choices[0].text)
    texts.append(completion.choices[0].text)
    return texts


def test_constrained_output_is_the_same_colocated_disaggregated_and_recomputed(
    tiny_llama_dir: Path,
) -> None:
    results: dict[str, list[str]] = {}

    def collect(name: str):
        async def body(stack: Stack) -> None:
            results[name] = await asyncio.to_thread(_constrained_outputs, stack)
            if name == "recomputed":
                retries = stack.gateway.metrics.retries.labels(cause="kv_recompute")
                assert retries._value.get() == 4  # every request took the recompute path
            await stack.wait_all_free()

        return body

    run_stack(tiny_llama_dir, collect("colocated"), colocated=True)
    run_stack(tiny_llama_dir, collect("disaggregated"))
    run_stack(
        tiny_llama_dir,
        collect("recomputed"),
        extra=("--on-kv-failure", "recompute", "--lease-ms", "300"),
        prefill_extra=("--test-kv-push-pause-s", "2"),
    )
    assert results["colocated"] == results["disaggregated"] == results["recomputed"]
    for text in results["colocated"][:2]:
        jsonschema.validate(json.loads(text), _SAME_SCHEMA)
    assert re.fullmatch("[a-f]{4}-[0-9]{2}", results["colocated"][2])
