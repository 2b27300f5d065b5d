"""``--reasoning-parser``: a thinking model's ``<think>`` text as ``reasoning_content``, apart
from ``content``, streamed or whole, as vLLM's qwen3 and deepseek_r1 parsers give it: the
splitter on its own (every way of cutting the text into deltas gives the same split), then
chat completions over a scripted generator that streams one token per chunk (so the tags
arrive cut into pieces)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.reasoning import ReasoningParser, ReasoningStream, split_reasoning
from gateway.text.tokenizer import Tokenizer
from support.openai_app import MODEL, TOOL, Served, output_script, sse_chunks
from support.openai_app import start as start_app

QWEN3, R1 = ReasoningParser.QWEN3, ReasoningParser.DEEPSEEK_R1
THOUGHT = "<think>\nThe user wants a city. Paris </ fits.\n</think>\n\nParis."


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        (QWEN3, THOUGHT, "\nThe user wants a city. Paris </ fits.\n", "\n\nParis."),
        (QWEN3, "Paris.", None, "Paris."),  # thinking switched off
        (QWEN3, "  <think>cut off by max_tokens", "cut off by max_tokens", None),
        (QWEN3, "a <think> later is text", None, "a <think> later is text"),
        (QWEN3, "<thin", None, "<thin"),
        (R1, "weighing it</think>Paris.", "weighing it", "Paris."),
        (R1, "<think>weighing it</think>Paris.", "weighing it", "Paris."),
        (R1, "all of it reasoning </thi", "all of it reasoning </thi", None),
        (R1, "</think>", None, None),
    ],
)
def test_split(parser: ReasoningParser, text: str, reasoning: str | None, content: str | None):
    assert split_reasoning(parser, text) == (reasoning, content)
    for size in range(1, 9):  # streamed in pieces of every size: the same split
        stream = ReasoningStream(parser)
        pieces = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
        pieces.append(stream.finish())
        streamed = "".join(r for r, _ in pieces), "".join(c for _, c in pieces)
        assert (streamed[0] or None, streamed[1] or None) == (reasoning, content), size


@pytest.fixture
def start(tokenizer: Tokenizer) -> Iterator[Any]:
    servers = []

    def make(text: str, parser: ReasoningParser | None = QWEN3) -> Served:
        served, server = start_app(
            tokenizer, output_script(tokenizer, text), reasoning_parser=parser, max_tokens=200
        )
        servers.append(server)
        return served

    yield make
    for server in servers:
        server.stop()


def _chat(served: Served, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A city?"}], **extra}
    response = served.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed(served: Served, **extra: Any) -> tuple[str, str, list[dict[str, Any]]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A city?"}], "stream": True}
    response = served.post("/v1/chat/completions", {**body, **extra})
    assert response.status_code == 200, response.text
    deltas = [chunk["choices"][0]["delta"] for chunk in sse_chunks(response) if chunk["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning, content, deltas


def test_chat_returns_reasoning_apart(start: Any) -> None:
    served = start(THOUGHT)
    text = served.tokenizer.decode(served.tokenizer.encode(THOUGHT, add_special_tokens=False))
    expected = split_reasoning(QWEN3, text)
    message = _chat(served)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == expected
    reasoning, content, deltas = _streamed(served)
    assert (reasoning, content) == expected
    assert deltas[0]["role"] == "assistant"  # with the first token, whatever it holds back
    first_reasoning = next(i for i, d in enumerate(deltas) if d.get("reasoning_content"))
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert first_reasoning < first_content
    assert not any("think>" in (d.get("content") or "") for d in deltas)


def test_include_reasoning_false_leaves_it_out(start: Any) -> None:
    served = start(THOUGHT)
    message = _chat(served, include_reasoning=False)["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].endswith("Paris.")
    reasoning, content, _ = _streamed(served, include_reasoning=False)
    assert reasoning == "" and content == message["content"]


def test_without_a_parser_or_with_a_grammar_the_text_is_content(start: Any) -> None:
    plain = _chat(start(THOUGHT, parser=None))["choices"][0]["message"]
    assert "reasoning_content" not in plain and "<think>" in plain["content"]
    # A grammar constrains the whole output: there is no reasoning to split off.
    served = start("weighing it</think>Paris.", parser=R1)
    guided = _chat(served, guided_regex=".*")["choices"][0]["message"]
    assert "reasoning_content" not in guided and "</think>" in guided["content"]


def test_tool_calls_after_the_reasoning(start: Any) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    served = start(f"<think>Use the tool.</think>{call}")
    choice = _chat(served, tools=[TOOL])["choices"][0]
    assert choice["message"]["reasoning_content"] == "Use the tool."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice["finish_reason"] == "tool_calls"
    reasoning, content, deltas = _streamed(served, tools=[TOOL])
    assert reasoning == "Use the tool." and content == ""
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"


def test_the_responses_api_gives_reasoning_its_own_item(start: Any) -> None:
    """``/v1/responses``: a ``reasoning`` item (its text as ``reasoning_text``) before the
    message, whole or streamed alike; the message holds the answer alone, and so does the
    stored turn a continuation sends back."""
    served = start(THOUGHT)
    client = served.client()
    whole = client.responses.create(model=MODEL, input="A city?")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    reasoning = whole.output[0]
    assert reasoning.content[0].text == "\nThe user wants a city. Paris </ fits.\n"
    assert whole.output_text == "\n\nParis."

    events = list(client.responses.create(model=MODEL, input="A city?", stream=True))
    kinds = [e.type for e in events]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == (reasoning.content[0].text, whole.output_text)
    # The reasoning item closes before the message opens.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in final.output]
    assert [e.output_index for e in events if e.type == "response.output_text.delta"][0] == 1

    client.responses.create(model=MODEL, input="Another?", previous_response_id=whole.id)
    prompt = served.tokenizer.decode(served.generator.requests[-1].prompt_token_ids)
    assert "\n\nParis." in prompt and "The user wants a city" not in prompt


def test_the_responses_api_without_a_parser_has_no_reasoning_item(start: Any) -> None:
    served = start(THOUGHT, parser=None)
    whole = served.client().responses.create(model=MODEL, input="A city?")
    assert [item.type for item in whole.output] == ["message"] and whole.output_text == THOUGHT


def test_a_whole_output_sent_back_as_input_leaves_the_reasoning_out(start: Any) -> None:
    """Clients replay a response's output items as the next input (the Agents SDK's
    ``to_input_list``): the reasoning item is accepted and kept out of the prompt."""
    served = start(THOUGHT)
    client = served.client()
    first = client.responses.create(model=MODEL, input="A city?")
    replay = [item.model_dump(mode="json", exclude_none=True) for item in first.output]
    client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "A city?"}, *replay,
                            {"role": "user", "content": "Another?"}],
    )  # fmt: skip
    expected = served.tokenizer.encode_chat(
        [{"role": "user", "content": "A city?"},
         {"role": "assistant", "content": first.output_text},
         {"role": "user", "content": "Another?"}]
    )  # fmt: skip
    assert list(served.generator.requests[-1].prompt_token_ids) == expected
