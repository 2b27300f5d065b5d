"""The OpenAI HTTP/SSE bridge, served by a real uvicorn and driven by the official ``openai``
client and by raw httpx, over a scripted fake generator and the real tiny-model tokenizer."""

from __future__ import annotations

import importlib.metadata
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import ErrorKind, GatewayError
from gateway.generation import Finished, GenerationRequest, TokenChunk
from gateway.routing.node_census import NodeCensus, RoleCensus
from gateway.text.tokenizer import Tokenizer
from services.convert import sampling_params_to_proto
from services.guided_decoding import MAX_CHOICES
from services.types import FinishReason, SamplingParams, Usage
from support.blocking_grammar import BlockingGrammarCheck
from support.openai_app import (
    HANG,
    MODEL,
    NO_HEALTHY_PAIR,
    OUTPUT_TEXT,
    SETTLE_S,
    TOOL,
    Script,
    Served,
    Step,
    ThreadedUvicorn,
    assert_error,
    output_script,
    sse_chunks,
    sse_lines,
    start,
    wait_until,
)


@pytest.fixture
def serve(tokenizer: Tokenizer) -> Iterator[Callable[..., Served]]:
    """``serve(script=None, api_keys=(), max_concurrent=8, max_queued=8, nodes=ONE_PAIR,
    **limits) -> Served``: a fresh app on its own port."""
    servers: list[ThreadedUvicorn] = []

    def make(*args: Any, **kwargs: Any) -> Served:
        served, server = start(tokenizer, *args, **kwargs)
        servers.append(server)
        return served

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def refusing(tokenizer: Tokenizer) -> Iterator[Served]:
    """One default app shared by the tests of refusals (they leave no state behind)."""
    served, server = start(tokenizer)
    yield served
    server.stop()


# --- the happy paths, through the official client ----------------------------------------------


def test_completion_with_the_openai_client(serve: Callable[..., Served]) -> None:
    served = serve()
    completion = served.client().completions.create(model=MODEL, prompt="Once upon a time")

    (request,) = served.generator.requests
    prompt_ids = served.tokenizer.encode("Once upon a time")
    assert request.prompt_token_ids == tuple(prompt_ids)
    assert request.sampling.max_tokens == 16  # OpenAI's default for completions
    assert request.request_id.startswith("cmpl-") and completion.id == request.request_id
    assert request.deadline == pytest.approx(request.arrival + 30.0)
    output_ids = served.tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)
    assert len(output_ids) > 16, "the script must run past max_tokens for this test"
    assert completion.choices[0].text == served.tokenizer.decode(output_ids[:16])
    assert completion.choices[0].finish_reason == "length"
    assert completion.model == MODEL and completion.object == "text_completion"
    usage = completion.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 16)
    assert usage.total_tokens == len(prompt_ids) + 16
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 3


def test_streamed_completion_with_the_openai_client(serve: Callable[..., Served]) -> None:
    served = serve()
    stream = served.client().completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=50, stream=True
    )
    chunks = list(stream)

    assert served.generator.requests[0].prompt_token_ids == (5, 6, 7)
    assert "".join(chunk.choices[0].text for chunk in chunks) == OUTPUT_TEXT
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == "stop"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])
    assert all(chunk.choices[0].text for chunk in chunks[:-1]), "no empty text chunks"


def test_chat_with_the_openai_client(serve: Callable[..., Served]) -> None:
    served = serve()
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
        },
    ]
    chat = served.client().chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]

    (request,) = served.generator.requests
    expected = served.tokenizer.encode_chat(
        [messages[0], {"role": "user", "content": "Hi\n!"}], add_generation_prompt=True
    )
    assert request.prompt_token_ids == tuple(expected)
    # Chat's default: what the context leaves, capped by the server's max_tokens.
    assert request.sampling.max_tokens == min(256 - len(expected), 100)
    assert request.request_id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == OUTPUT_TEXT
    assert chat.choices[0].finish_reason == "stop"
    assert chat.object == "chat.completion"


def test_streamed_chat_sends_the_role_with_the_first_token(serve: Callable[..., Served]) -> None:
    served = serve()
    stream = served.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=80,
        max_completion_tokens=7,
        stream=True,
    )
    chunks = list(stream)

    assert served.generator.requests[0].sampling.max_tokens == 7  # max_completion_tokens wins
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content, "role rides with the first content"
    assert all(chunk.choices[0].delta.role is None for chunk in chunks[1:])
    output_ids = served.tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == served.tokenizer.decode(output_ids[:7])
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].object == "chat.completion.chunk"


# --- SSE framing ------------------------------------------------------------------------------


def test_sse_framing_and_the_usage_chunk(serve: Callable[..., Served]) -> None:
    served = serve()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = served.post("/v1/chat/completions", body, headers={"X-Request-Id": "abc-1"})

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"] == "abc-1"
    chunks = sse_chunks(response)
    assert {chunk["id"] for chunk in chunks} == {"abc-1"}
    *token_chunks, finish, usage_chunk = chunks
    assert len(token_chunks) == 5
    assert token_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(set(chunk["choices"][0]["delta"]) == {"content"} for chunk in token_chunks[1:])
    assert all(chunk["usage"] is None for chunk in token_chunks + [finish])
    assert finish["choices"] == [
        {
            "index": 0,
            "delta": {},  # unset fields are not sent, as OpenAI and vLLM do
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    assert usage_chunk["choices"] == []
    prompt_len = len(served.generator.requests[0].prompt_token_ids)
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 5,
        "total_tokens": prompt_len + 5,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert served.generator.requests[0].request_id == "abc-1"


def test_stream_error_before_the_first_token_keeps_its_status(
    serve: Callable[..., Served],
) -> None:
    def script(request: GenerationRequest) -> list[Step]:
        return [0.2, GatewayError(ErrorKind.RESOURCE_EXHAUSTED, "every decode node is full")]

    served = serve(script)
    body = {"model": MODEL, "prompt": "x", "stream": True}
    error = assert_error(served.post("/v1/completions", body), 429, None)
    assert error["message"] == "every decode node is full"
    assert error["type"] == "rate_limit_error"


def test_one_choice_refused_before_output_fails_the_request_and_closes_the_others(
    serve: Callable[..., Served], tokenizer: Tokenizer
) -> None:
    first_id = tokenizer.encode("Hi", add_special_tokens=False)[0]

    def script(request: GenerationRequest) -> list[Step]:
        if request.request_id.endswith("-1"):
            return [0.2, GatewayError(ErrorKind.UNAVAILABLE, "no healthy decode node")]
        return [TokenChunk((first_id,)), HANG]

    served = serve(script)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "x", "n": 2, "stream": stream}
        response = served.post("/v1/completions", body, headers={"X-Request-Id": f"r{stream}"})
        error = assert_error(response, 503, None)
        assert error["message"] == "no healthy decode node"
        wait_until(lambda stream=stream: f"r{stream}-0" in served.generator.closed_ids)
    metrics = httpx.get(f"{served.url}/metrics").text
    assert 'pdserve:request_errors_total{reason="unavailable"} 2.0' in metrics


def test_a_choice_that_ends_before_any_token(serve: Callable[..., Served]) -> None:
    served = serve(lambda request: [Finished(FinishReason.ABORT, Usage(3, 0))])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    (chunk,) = sse_chunks(served.post("/v1/chat/completions", body))
    assert "usage" not in chunk  # sent (null until the end) only with include_usage, as OpenAI
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk["choices"][0]["finish_reason"] == "abort"

    chat = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}]
    )
    assert chat.choices[0].message.content == ""
    assert chat.choices[0].finish_reason == "abort"  # type: ignore[comparison-overlap]


def test_an_error_after_tokens_ends_the_stream_with_an_error_event(
    serve: Callable[..., Served], tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode("Hello there", add_special_tokens=False)

    def script(request: GenerationRequest) -> list[Step]:
        usage = Usage(len(request.prompt_token_ids), len(ids))
        return [TokenChunk(tuple(ids)), Finished(FinishReason.ERROR, usage, error="decode died")]

    served = serve(script)
    body = {"model": MODEL, "prompt": "x", "stream": True}
    response = served.post("/v1/completions", body)

    assert response.status_code == 200
    lines = sse_lines(response)
    assert lines[-1] == "[DONE]"
    text_chunk, finish_chunk, error_event = (json.loads(line) for line in lines[:-1])
    assert "usage" not in text_chunk and "usage" not in finish_chunk  # no include_usage
    assert text_chunk["choices"][0]["text"] == "Hello there"
    assert finish_chunk["choices"][0]["finish_reason"] == "error"
    assert "decode died" in error_event["error"]["message"]

    with pytest.raises(openai.APIError, match="decode died"):
        list(served.client().completions.create(model=MODEL, prompt="x", stream=True))
    # Not streamed: nothing reached the client, so the whole request is an error.
    assert_error(served.post("/v1/completions", {"model": MODEL, "prompt": "x"}), 503, None)


def test_a_grammar_that_fails_while_running_is_the_clients_error(
    serve: Callable[..., Served], tokenizer: Tokenizer
) -> None:
    """The node says the request itself failed (its grammar, after tokens went out): a 400 /
    ``invalid_request_error``, which clients do not retry, not the 503 of a node failure, which
    the OpenAI SDK retries twice. One choice failing for a node's reason makes it a 503."""
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    grammar_error = "guided.grammar: the grammar failed at token 3"

    def script(request: GenerationRequest) -> list[Step]:
        usage = Usage(len(request.prompt_token_ids), len(ids))
        node_fault = request.request_id.endswith("-1")  # the second choice of n = 2
        return [
            TokenChunk(tuple(ids)),
            Finished(
                FinishReason.ERROR,
                usage,
                error="decode died" if node_fault else grammar_error,
                invalid_request=not node_fault,
            ),
        ]

    served = serve(script)
    error = assert_error(served.post("/v1/completions", {"model": MODEL, "prompt": "x"}), 400, None)
    assert error["type"] == "invalid_request_error"
    assert grammar_error in error["message"]

    response = served.post("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
    assert response.status_code == 200
    *chunks, error_event = sse_chunks(response)
    assert chunks[-1]["choices"][0]["finish_reason"] == "error"
    assert error_event["error"]["type"] == "invalid_request_error"
    assert grammar_error in error_event["error"]["message"]

    # Counted as the client's error, not as a stream failure.
    metrics = httpx.get(f"{served.url}/metrics").text
    assert 'pdserve:request_errors_total{reason="invalid_argument"} 2.0' in metrics
    assert 'reason="stream_error"' not in metrics

    body = {"model": MODEL, "prompt": "x", "n": 2}
    error = assert_error(served.post("/v1/completions", body), 503, None)
    assert error["type"] == "service_unavailable"
    assert "decode died" in error["message"] and grammar_error in error["message"]
    *_, error_event = sse_chunks(served.post("/v1/completions", {**body, "stream": True}))
    assert error_event["error"]["type"] == "service_unavailable"


# --- n, stop strings, logprobs ----------------------------------------------------------------


def test_n_choices_run_concurrently_with_their_own_ids_and_seeds(
    serve: Callable[..., Served],
) -> None:
    served = serve()
    body = {"model": MODEL, "prompt": ["one", "two"], "n": 3, "seed": 7, "max_tokens": 4}
    response = served.post("/v1/completions", body, headers={"X-Request-Id": "req"})

    assert response.status_code == 200, response.text
    requests = {request.request_id: request for request in served.generator.requests}
    assert sorted(requests) == [f"req-{index}" for index in range(6)]
    assert [requests[f"req-{index}"].sampling.seed for index in range(6)] == [7, 8, 9] * 2
    one, two = (tuple(served.tokenizer.encode(text)) for text in ("one", "two"))
    assert [requests[f"req-{index}"].prompt_token_ids for index in range(6)] == [one] * 3 + [
        two
    ] * 3
    payload = response.json()
    assert [choice["index"] for choice in payload["choices"]] == list(range(6))
    # Prompts count once each; completion tokens add up over the six choices.
    assert payload["usage"]["prompt_tokens"] == len(one) + len(two)
    assert payload["usage"]["completion_tokens"] == 6 * 4


def test_sampling_parameters_reach_the_generator(serve: Callable[..., Served]) -> None:
    served = serve()
    params = {
        "temperature": 0.5, "top_p": 0.9, "top_k": 0, "min_p": 0.1, "seed": 2**63 - 1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
        "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [3, 4], "max_tokens": 5, "n": 2,
    }  # fmt: skip
    assert served.post("/v1/completions", {"model": MODEL, "prompt": "x", **params}).is_success
    first, second = sorted(served.generator.requests, key=lambda request: request.request_id)
    assert first.sampling == SamplingParams(
        max_tokens=5, min_tokens=2, temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1,
        seed=2**63 - 1, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5,
        stop_token_ids=(3, 4), ignore_eos=True,
    )  # fmt: skip
    assert second.sampling.seed == -(2**63), "seed + 1 wraps around within int64"


def test_a_top_k_past_the_vocabulary_means_no_top_k(serve: Callable[..., Served]) -> None:
    """vLLM takes any top_k >= 1; one the vocabulary cannot fill is no filter at all, and must
    not reach the nodes as a number their int32 field cannot hold (that was a 500)."""
    served = serve()
    vocab_size = served.tokenizer.vocab_size
    for top_k, expected in ((2**40, -1), (vocab_size, -1), (vocab_size - 1, vocab_size - 1)):
        body = {"model": MODEL, "prompt": "x", "top_k": top_k}
        assert served.post("/v1/completions", body).status_code == 200
        sampling = served.generator.requests[-1].sampling
        assert sampling.top_k == expected
        assert sampling_params_to_proto(sampling).top_k == expected


def test_n_choices_stream_with_their_indexes(serve: Callable[..., Served]) -> None:
    served = serve()
    stream = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=3, stream=True
    )
    texts = {0: "", 1: ""}
    finishes = {}
    roles = {0: 0, 1: 0}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    output_ids = served.tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)
    assert texts == {index: served.tokenizer.decode(output_ids[:3]) for index in (0, 1)}
    assert finishes == {0: "length", 1: "length"}
    assert roles == {0: 1, 1: 1}


def test_the_token_that_stopped_the_generation_is_not_in_the_text(
    serve: Callable[..., Served],
) -> None:
    """As vLLM: a stop token's text is left out and its id is the stop_reason; an EOS's text is
    left out even when special tokens are kept."""
    output_ids = []

    def script(request: GenerationRequest) -> list[Step]:
        ids = output_ids[: request.sampling.max_tokens]
        return [*(TokenChunk((i,)) for i in ids), Finished(FinishReason.STOP, Usage(1, len(ids)))]

    served = serve(script)
    output_ids[:] = served.tokenizer.encode("Hello world", add_special_tokens=False)
    stop_id = output_ids[-1]
    body = {"model": MODEL, "prompt": "x", "stop_token_ids": [stop_id]}
    (choice,) = served.post("/v1/completions", body).json()["choices"]
    assert choice["text"] == "Hello"
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
    chunks = sse_chunks(served.post("/v1/chat/completions", {**chat, "stop_token_ids": [stop_id]}))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Hello"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop_id

    (eos,) = served.tokenizer.eos_token_ids
    output_ids.append(eos)
    body = {"model": MODEL, "prompt": "x", "skip_special_tokens": False}
    (choice,) = served.post("/v1/completions", body).json()["choices"]
    assert (choice["text"], choice["stop_reason"]) == ("Hello world", None)


def test_stop_string_truncates_and_closes_the_generation(serve: Callable[..., Served]) -> None:
    served = serve()
    completion = served.client().completions.create(
        model=MODEL, prompt="x", max_tokens=50, stop=[" test", "zzz"]
    )
    assert completion.choices[0].text == "Hello world, this is a"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].model_extra == {"stop_reason": " test"}
    assert served.generator.closed.wait(SETTLE_S), "a stop string must close the generator"

    completion = served.client().completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=50,
        stop=" test",
        extra_body={"include_stop_str_in_output": True},
    )
    assert completion.choices[0].text == "Hello world, this is a test"

    # min_tokens holds stop strings back as it holds EOS back (vLLM): "o" ends "Hello" (3 tokens).
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stop": "o"}
    assert served.post("/v1/completions", body).json()["choices"][0]["text"] == "Hell"
    body["min_tokens"] = 3
    assert served.post("/v1/completions", body).json()["choices"][0]["text"] == "Hello w"


def test_completion_logprobs_in_the_legacy_format(serve: Callable[..., Served]) -> None:
    served = serve()
    completion = served.client().completions.create(
        model=MODEL, prompt="x", max_tokens=4, logprobs=2
    )

    assert served.generator.requests[0].sampling.logprobs == 2
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    output_ids = served.tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:4]
    assert logprobs.tokens == [served.tokenizer.token_text(t) for t in output_ids]
    assert logprobs.token_logprobs == [-0.25] * 4
    assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs) == 4
    assert logprobs.top_logprobs[0] == {
        served.tokenizer.token_text(output_ids[0]): -0.25,
        served.tokenizer.token_text(output_ids[0] + 1): -1.5,
    }
    text = completion.choices[0].text
    offsets = logprobs.text_offset
    assert offsets is not None and offsets[0] == 0
    assert [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)], strict=True)] == (
        logprobs.tokens
    )

    stream = served.client().completions.create(
        model=MODEL, prompt="x", max_tokens=4, logprobs=2, stream=True
    )
    streamed = [chunk.choices[0].logprobs for chunk in stream if chunk.choices[0].text]
    assert [lp.tokens for lp in streamed if lp] == [[token] for token in logprobs.tokens]
    assert [lp.text_offset for lp in streamed if lp] == [[offset] for offset in offsets]


def test_chat_logprobs_with_bytes_and_alternatives(serve: Callable[..., Served]) -> None:
    served = serve()
    stream = served.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    entries = [
        entry
        for chunk in stream
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content or ()
    ]

    output_ids = served.tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:3]
    assert [entry.token for entry in entries] == [
        served.tokenizer.token_text(t) for t in output_ids
    ]
    for entry, token_id in zip(entries, output_ids, strict=True):
        assert entry.bytes == list(served.tokenizer.token_bytes(token_id))
        assert entry.logprob == -0.25
        assert [top.logprob for top in entry.top_logprobs] == [-0.25, -1.5, -9999.0]


def test_return_tokens_as_token_ids_names_tokens_by_id(serve: Callable[..., Served]) -> None:
    served = serve()
    output_ids = served.tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:3]
    named = [f"token_id:{t}" for t in output_ids]
    body = {"model": MODEL, "max_tokens": 3, "return_tokens_as_token_ids": True}
    completion = served.post(
        "/v1/completions", {**body, "prompt": "x", "logprobs": 1, "echo": True}
    ).json()
    logprobs = completion["choices"][0]["logprobs"]
    prompt_ids = served.generator.requests[-1].prompt_token_ids
    assert logprobs["tokens"] == [f"token_id:{t}" for t in prompt_ids] + named
    assert logprobs["top_logprobs"][-3] == {named[0]: -0.25}
    # The offsets still index the text.
    text, offsets = completion["choices"][0]["text"], logprobs["text_offset"]
    pieces = [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)], strict=True)]
    assert pieces[-3:] == [served.tokenizer.token_text(t) for t in output_ids]

    chat = served.post(
        "/v1/chat/completions",
        {**body, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
         "top_logprobs": 2},
    ).json()  # fmt: skip
    content = chat["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == named
    assert [entry["bytes"] for entry in content] == [list(name.encode()) for name in named]
    assert content[0]["top_logprobs"][1]["token"] == f"token_id:{output_ids[0] + 1}"


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "change", "status", "param"),
    [
        ("/v1/completions", {"max_tokens": "5"}, 400, "max_tokens"),
        ("/v1/completions", {"temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"stream": "yes"}, 400, "stream"),
        ("/v1/completions", {"prompt": None}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [999999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
        ("/v1/completions", {"model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [3] * 200, "max_tokens": 90}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [3] * 256}, 400, "prompt"),
        ("/v1/completions", {"n": 17}, 400, "n"),
        ("/v1/completions", {"n": 0}, 400, "n"),
        ("/v1/completions", {"stop": ["a"] * 17}, 400, "stop"),
        ("/v1/completions", {"stop": ""}, 400, "stop"),
        ("/v1/completions", {"logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": -1}, 400, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, 400,
         "prompt_logprobs"),
        ("/v1/completions", {"suffix": "end"}, 400, "suffix"),
        ("/v1/completions", {"best_of": 3}, 400, "best_of"),
        ("/v1/completions", {"logit_bias": {"five": 1.0}}, 400, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101.0}}, 400, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"999999": 1.0}}, 400, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"\u00b2": 1.0}}, 400, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"\u0663": 1.0}}, 400, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"9" * 5000: 1.0}}, 400, "logit_bias"),
        ("/v1/completions", {"guided_regex": "[a-"}, 400, "guided_regex"),
        ("/v1/completions", {"guided_choice": []}, 400, "guided_choice"),
        ("/v1/completions", {"guided_choice": ["a"] * (MAX_CHOICES + 1)}, 400, "guided_choice"),
        ("/v1/completions", {"guided_grammar": "start: nowhere"}, 400, "guided_grammar"),
        ("/v1/completions", {"guided_json": {"type": "objekt"}}, 400, "guided_json"),
        ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
        ("/v1/completions", {"min_tokens": 20}, 400, "min_tokens"),
        ("/v1/completions", {"top_k": -2}, 400, "top_k"),
        ("/v1/completions", {"seed": 2**63}, 400, "seed"),
        ("/v1/completions", {"stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        ("/v1/completions", {"allowed_token_ids": [10**6]}, 400, "allowed_token_ids"),
        ("/v1/completions", {"allowed_token_ids": []}, 400, "allowed_token_ids"),
        ("/v1/completions", {"allowed_token_ids": [-1]}, 400, "allowed_token_ids[0]"),
        ("/v1/completions", {"truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"frobnicate": 1}, 400, "frobnicate"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
         "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"},
         {"role": "tool", "content": "42"}]}, 400, "messages[1].tool_call_id"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, 400, "tools[0]"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, 400, "tool_choice"),
        ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "sometimes"}, 400,
         "tool_choice"),
        ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": {"type": "function",
         "function": {"name": "nope"}}}, 400, "tool_choice"),
        ("/v1/chat/completions", {"tools": [TOOL, TOOL]}, 400, "tools[1]"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
         "name": "f", "parameters": {"type": "objekt"}}}], "tool_choice": "required"}, 400,
         "tools"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "objekt"}}}}, 400, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, 400,
         "response_format.json_schema"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, 400,
         "response_format.type"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"},
         "guided_regex": "a"}, 400, "guided_regex"),
        ("/v1/chat/completions", {"top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"max_completion_tokens": 10**6}, 400,
         "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400,
         "messages[0].content[0].type"),
    ],
)  # fmt: skip
def test_bad_requests_name_their_param(
    refusing: Served, path: str, change: dict[str, Any], status: int, param: str
) -> None:
    served = refusing
    if path.endswith("/chat/completions"):
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    else:
        body = {"model": MODEL, "prompt": "Hi"}
    body.update(change)
    assert_error(served.post(path, body), status, param)
    assert served.generator.requests == [], "no node is asked for a refused request"


def test_allowed_token_ids_reach_the_nodes(serve: Callable[..., Served]) -> None:
    served = serve()
    body = {"model": MODEL, "prompt": "x", "allowed_token_ids": [9, 5, 9]}
    assert served.post("/v1/completions", body).status_code == 200
    assert served.generator.requests[-1].sampling.allowed_token_ids == (5, 9)
    eos = served.tokenizer.eos_token_ids[0]
    conflict = {"model": MODEL, "prompt": "x", "allowed_token_ids": [eos], "min_tokens": 1}
    assert_error(served.post("/v1/completions", conflict), 400, "allowed_token_ids")
    assert len(served.generator.requests) == 1


def test_priority_reaches_the_nodes(serve: Callable[..., Served]) -> None:
    served = serve()
    body = {"model": MODEL, "prompt": "x", "priority": -7}
    assert served.post("/v1/completions", body).status_code == 200
    assert served.generator.requests[-1].sampling.priority == -7
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "priority": 3}
    assert served.post("/v1/chat/completions", chat).status_code == 200
    assert served.generator.requests[-1].sampling.priority == 3
    # The nodes' protobuf field is int32.
    assert_error(served.post("/v1/completions", {**body, "priority": 2**31}), 400, "priority")
    assert len(served.generator.requests) == 2


def test_cache_salt_reaches_the_nodes(serve: Callable[..., Served]) -> None:
    served = serve()
    body = {"model": MODEL, "prompt": "x", "cache_salt": "tenant-a-secret"}
    assert served.post("/v1/completions", body).status_code == 200
    assert served.generator.requests[-1].sampling.cache_salt == "tenant-a-secret"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "cache_salt": "b"}
    assert served.post("/v1/chat/completions", chat).status_code == 200
    assert served.generator.requests[-1].sampling.cache_salt == "b"
    assert served.post("/v1/completions", {**body, "cache_salt": None}).status_code == 200
    assert served.generator.requests[-1].sampling.cache_salt is None
    for bad in ("", 7, ["a"]):
        assert_error(served.post("/v1/completions", {**body, "cache_salt": bad}), 400, "cache_salt")
    assert len(served.generator.requests) == 3


def test_version_needs_no_key(serve: Callable[..., Served]) -> None:
    served = serve(api_keys=("sesame",))
    response = httpx.get(f"{served.url}/version", timeout=5)
    assert response.status_code == 200
    assert response.json() == {"version": importlib.metadata.version("pdserve")}


def test_null_means_the_default(serve: Callable[..., Served]) -> None:
    served = serve()
    names = "n stream echo ignore_eos skip_special_tokens stop include_stop_str_in_output logprobs"
    nulls = dict.fromkeys([*names.split(), "temperature", "seed"])
    response = served.post("/v1/completions", {"model": MODEL, "prompt": "x", **nulls})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    (request,) = served.generator.requests
    assert request.sampling.logprobs is None and not request.sampling.ignore_eos
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": None}
    assert served.post("/v1/chat/completions", body).status_code == 200


def test_model_may_be_left_out_and_fields_of_stored_completions_are_ignored(
    serve: Callable[..., Served],
) -> None:
    """As vLLM: no ``model`` (or null) means the served one; ``store``, ``metadata`` and
    ``service_tier``, which the ``openai`` SDK passes through, are accepted."""
    served = serve()
    for model in ({}, {"model": None}):
        response = served.post("/v1/completions", {"prompt": "x", **model})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == MODEL
    chat = served.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        store=False,
        metadata={"team": "a"},
        service_tier="auto",
    )
    assert chat.model == MODEL and chat.choices[0].message.content == OUTPUT_TEXT
    assert len(served.generator.requests) == 3


def test_malformed_bodies_are_400s(serve: Callable[..., Served]) -> None:
    served = serve()
    url = f"{served.url}/v1/completions"
    json_headers = {"content-type": "application/json"}
    assert_error(httpx.post(url, content=b'{"model": ', headers=json_headers), 400, None)
    assert_error(httpx.post(url, content=b"[1, 2]", headers=json_headers), 400, None)
    assert_error(httpx.post(url, content=b"", headers=json_headers), 400, None)
    nested = b"[" * 100_000 + b"]" * 100_000
    assert_error(httpx.post(url, content=nested, headers=json_headers), 400, None)
    error = assert_error(served.post("/v1/completions", {"prompt": {"a": 1}}), 400, "prompt")
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    bad_id = {"X-Request-Id": "has spaces"}
    assert_error(served.post("/v1/completions", {"model": MODEL, "prompt": "x"}, headers=bad_id),
                 400, None)  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"model": "M", "prompt": "a\\ud800"}', "prompt"),
        ("/v1/completions", '{"model": "M", "prompt": ["a", "\\udfff"]}', "prompt"),
        ("/v1/completions", '{"model": "M", "prompt": "a", "stop": "\\ud800"}', "stop"),
        ("/v1/completions", '{"model": "M", "prompt": "a", "\\ud800": 1}', None),
        ("/v1/completions", '{"model": "M", "prompt": "a", "foo-bar": 1}', "foo-bar"),
        ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", '
         '"content": "\\ud800"}]}', "messages[0].content"),
        ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", '
         '"content": "hi", "name": "\\ud800"}]}', "messages[0].name"),
    ],
)  # fmt: skip
def test_lone_surrogates_and_odd_keys_are_400s(
    refusing: Served, path: str, body: str, param: str | None
) -> None:
    """JSON can spell what UTF-8 cannot; such strings must not reach the tokenizer (a 500)."""
    served = refusing
    content = body.replace('"M"', json.dumps(MODEL)).encode()
    response = httpx.post(
        f"{served.url}{path}", content=content, headers={"content-type": "application/json"}
    )
    assert_error(response, 400, param)
    assert served.generator.requests == []


def test_oversized_bodies_are_413s(serve: Callable[..., Served]) -> None:
    served = serve(max_body_bytes=1000)
    body = {"model": MODEL, "prompt": "x" * 2000}
    assert_error(served.post("/v1/completions", body), 413, None)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the size is only known by reading
        yield json.dumps(body).encode()

    response = httpx.post(
        f"{served.url}/v1/completions",
        content=chunked(),
        headers={"content-type": "application/json"},
    )
    assert "content-length" not in response.request.headers
    assert_error(response, 413, None)
    assert served.post("/v1/completions", {"model": MODEL, "prompt": "x"}).status_code == 200


def test_unknown_paths_are_404s_in_the_openai_shape(serve: Callable[..., Served]) -> None:
    served = serve()
    error = assert_error(httpx.get(f"{served.url}/v1/nothing"), 404, None)
    assert error["type"] == "not_found_error"
    assert httpx.get(f"{served.url}/v1/completions").status_code == 405


def test_api_keys_guard_v1_but_not_health_or_metrics(serve: Callable[..., Served]) -> None:
    served = serve(api_keys=("sesame",))
    body = {"model": MODEL, "prompt": "x"}
    assert_error(served.post("/v1/completions", body), 401, None)
    assert_error(
        served.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401, None
    )
    assert_error(httpx.get(f"{served.url}/v1/models"), 401, None)
    with pytest.raises(openai.AuthenticationError):
        served.client("wrong").models.list()
    assert served.client("sesame").completions.create(**body).choices[0].text  # type: ignore[call-overload]
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert httpx.get(f"{served.url}/metrics").status_code == 200


def test_a_full_queue_is_a_429_and_a_stream_holds_its_slot(
    serve: Callable[..., Served], tokenizer: Tokenizer
) -> None:
    first_id = tokenizer.encode("Hi", add_special_tokens=False)[0]

    def script(request: GenerationRequest) -> list[Step]:
        if request.request_id == "slow":
            return [TokenChunk((first_id,)), HANG]
        return [TokenChunk((first_id,)), Finished(FinishReason.STOP, Usage(1, 1))]

    served = serve(script, max_concurrent=1, max_queued=0)
    body = {"model": MODEL, "prompt": "x", "stream": True}
    with (
        httpx.Client(base_url=served.url, timeout=10) as client,
        client.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "slow"}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()  # NOTE: dropping the iterator would close the connection
        next(lines)  # the slow stream is running: it holds the only slot
        assert_error(served.post("/v1/completions", {**body, "stream": False}), 429, None)
        assert "pdserve:num_requests_running 1.0" in httpx.get(f"{served.url}/metrics").text
    # The slow stream's client left: its slot comes back.
    wait_until(lambda: served.frontend.admission.num_running == 0)
    assert served.post("/v1/completions", {**body, "stream": False}).status_code == 200
    metrics = httpx.get(f"{served.url}/metrics").text
    assert 'pdserve:request_errors_total{reason="resource_exhausted"} 1.0' in metrics
    assert "pdserve:request_queue_time_seconds_count 2.0" in metrics


# --- client disconnects ----------------------------------------------------------------------


def _hang_after_one_token(tokenizer: Tokenizer) -> Script:
    first_id = tokenizer.encode("Hi", add_special_tokens=False)[0]
    return lambda request: [TokenChunk((first_id,)), HANG]


def test_disconnect_mid_stream_closes_the_generation(
    serve: Callable[..., Served], tokenizer: Tokenizer
) -> None:
    served = serve(_hang_after_one_token(tokenizer))
    body = {"model": MODEL, "prompt": "x", "stream": True}
    with (
        httpx.Client(base_url=served.url, timeout=10) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        time.sleep(0.2)
        assert not served.generator.closed.is_set()
    assert served.generator.closed.wait(SETTLE_S), "a disconnect must close the generator"
    wait_until(lambda: served.frontend.admission.num_running == 0)


def test_disconnect_mid_non_stream_closes_the_generation(
    serve: Callable[..., Served], tokenizer: Tokenizer
) -> None:
    served = serve(_hang_after_one_token(tokenizer))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{served.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=0.5
        )
    assert served.generator.closed.wait(SETTLE_S), "a non-streaming disconnect must close it too"
    wait_until(lambda: served.frontend.admission.num_running == 0)


def test_disconnect_before_the_first_token_closes_the_generation(
    serve: Callable[..., Served],
) -> None:
    served = serve(lambda request: [HANG])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=0.5)
    assert served.generator.closed.wait(SETTLE_S)


def test_a_client_that_stops_reading_is_cut_off_and_others_stream_on(
    serve: Callable[..., Served], tokenizer: Tokenizer
) -> None:
    slow_prompt_ids = tuple(tokenizer.encode("never read"))
    token_id = tokenizer.encode("Hi", add_special_tokens=False)[0]
    output = output_script(tokenizer)

    def script(request: GenerationRequest) -> list[Step]:
        if request.prompt_token_ids != slow_prompt_ids:
            return output(request)
        # Far more SSE bytes than the small socket buffers hold, then no end: only the send
        # bound can end this request.
        return [TokenChunk((token_id,))] * request.sampling.max_tokens + [HANG]

    served = serve(
        script,
        client_send_timeout_s=0.5,
        send_buffer_bytes=4096,
        max_model_len=8192,
        max_tokens=8000,
    )
    body = json.dumps(
        {"model": MODEL, "prompt": "never read", "max_tokens": 8000, "stream": True}
    ).encode()
    with socket.socket() as slow:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
        slow.connect(("127.0.0.1", int(served.url.rsplit(":", 1)[1])))
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nX-Request-Id: slow\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        slow.sendall(head + body)
        wait_until(lambda: len(served.generator.requests) == 1)

        with served.client().completions.create(
            model=MODEL, prompt="x", max_tokens=100, stream=True
        ) as stream:
            text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == OUTPUT_TEXT

        assert served.generator.closed.wait(SETTLE_S), "the send bound must close the generation"
        assert served.generator.closed_ids == ["slow"]
        wait_until(lambda: served.frontend.admission.num_running == 0)
        metrics = httpx.get(f"{served.url}/metrics").text
        assert 'pdserve:request_errors_total{reason="slow_client"} 1.0' in metrics
        # The connection ends after what was already buffered, without the stream's end.
        slow.settimeout(10)
        received = b"".join(iter(lambda: slow.recv(2**16), b""))
    assert received.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" not in received


def test_server_shutdown_ends_open_streams_with_abort(tokenizer: Tokenizer) -> None:
    served, server = start(tokenizer, _hang_after_one_token(tokenizer))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with (
        httpx.Client(base_url=served.url, timeout=10) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        stopping = threading.Thread(target=server.stop)
        stopping.start()  # uvicorn waits 1 s for the stream, then cancels it
        rest = [line for line in lines if line]
        stopping.join()
    assert rest[-1] == "data: [DONE]"
    finish = json.loads(rest[-2].removeprefix("data: "))
    assert finish["choices"][0]["finish_reason"] == "abort"
    assert served.generator.closed.is_set()


def test_server_shutdown_before_the_first_token_is_a_503(tokenizer: Tokenizer) -> None:
    served, server = start(tokenizer, lambda request: [HANG])
    stopping = threading.Timer(0.3, server.stop)
    stopping.start()
    response = served.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    stopping.join()
    assert_error(response, 503, None)
    assert served.generator.closed.is_set()


# --- the other routes ------------------------------------------------------------------------


def test_models_health_and_metrics(serve: Callable[..., Served]) -> None:
    served = serve()
    (model,) = served.client().models.list().data
    assert model.id == MODEL and model.owned_by == "pdserve"
    card = httpx.get(f"{served.url}/v1/models").json()["data"][0]
    assert card["root"] == MODEL and card["parent"] is None  # vLLM's fields, as its clients read
    assert card["max_model_len"] > 0
    assert served.client().models.retrieve(MODEL).id == MODEL
    assert_error(httpx.get(f"{served.url}/v1/models/other"), 404, "model")
    assert httpx.get(f"{served.url}/health").json()["status"] == "ok"
    metrics = httpx.get(f"{served.url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "pdserve:request_queue_time_seconds" in metrics.text

    not_ready = serve(nodes=NO_HEALTHY_PAIR)
    assert_error(httpx.get(f"{not_ready.url}/health"), 503, None)


def test_health_counts_the_healthy_and_known_nodes_of_each_role(
    serve: Callable[..., Served],
) -> None:
    # One pair of two is enough to serve (200), and the body says the other is not up yet: what
    # the launcher waits for before its banner.
    half_up = NodeCensus(prefill=RoleCensus(2, 2), decode=RoleCensus(1, 2))
    response = httpx.get(f"{serve(nodes=half_up).url}/health")
    assert response.status_code == 200
    assert response.json() == {
        "status": "ok",
        "nodes": {
            "prefill": {"healthy": 2, "total": 2},
            "decode": {"healthy": 1, "total": 2},
            "colocated": {"healthy": 0, "total": 0},
        },
    }
    colocated_only = NodeCensus(prefill=RoleCensus(0, 1), colocated=RoleCensus(1, 1))
    nodes = httpx.get(f"{serve(nodes=colocated_only).url}/health").json()["nodes"]
    assert nodes["colocated"] == {"healthy": 1, "total": 1}
    assert_error(httpx.get(f"{serve(nodes=NodeCensus()).url}/health"), 503, None)


def test_openapi_document(serve: Callable[..., Served]) -> None:
    served = serve()
    document = httpx.get(f"{served.url}/openapi.json").json()
    assert document["openapi"].startswith("3.")
    paths = document["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(
        paths
    )
    completions = paths["/v1/completions"]["post"]
    assert "422" not in completions["responses"]
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(completions["responses"])
    assert "text/event-stream" in completions["responses"]["200"]["content"]
    assert "HTTPValidationError" not in document["components"]["schemas"]
    n = document["components"]["schemas"]["CompletionRequest"]["properties"]["n"]
    assert "seed + i" in n["description"], "the n/seed contract is documented"

    def refs(node: object) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref":
                    yield value
                else:
                    yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    schemas = document["components"]["schemas"]
    for ref in refs(document):
        assert ref.startswith("#/components/schemas/") and ref.split("/")[-1] in schemas, ref


# --- no 5xx for any body ---------------------------------------------------------------------

_FIELDS = (
    "model prompt messages max_tokens max_completion_tokens n stream stream_options stop "
    "temperature top_p top_k min_p seed presence_penalty frequency_penalty repetition_penalty "
    "min_tokens ignore_eos stop_token_ids skip_special_tokens include_stop_str_in_output "
    "logprobs top_logprobs echo suffix best_of logit_bias user tools tool_choice response_format "
    "guided_json guided_regex guided_choice guided_grammar parallel_tool_calls "
    "add_generation_prompt continue_final_message chat_template_kwargs allowed_token_ids "
    "include_reasoning truncate_prompt_tokens prompt_logprobs structured_outputs bad_words "
    "priority return_tokens_as_token_ids add_special_tokens cache_salt"
).split()


def _json_values() -> st.SearchStrategy[object]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.integers(min_value=-3, max_value=40)
        | st.floats()
        | st.text(max_size=20)
        | st.sampled_from(["\ud800", MODEL, "user", "text", "image_url", "", "none"])
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    ["role", "content", "type", "text", "include_usage", "continuous_usage_stats"]
                )
                | st.text(max_size=5),
                children,
                max_size=4,
            )
        ),  # fmt: skip
        max_leaves=12,
    )


@pytest.mark.slow
def test_no_body_gets_a_5xx(serve: Callable[..., Served]) -> None:
    served = serve()
    client = httpx.Client(base_url=served.url, timeout=10)
    bases = {
        "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 3},
        "/v1/chat/completions": {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
        },
    }

    @settings(
        max_examples=200,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        path=st.sampled_from(sorted(bases)),
        changes=st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=5), _json_values()),
    )
    def check(path: str, changes: dict[str, object]) -> None:
        body = json.dumps({**bases[path], **changes}).encode()  # NaN and Infinity included
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code < 500, response.text
        if response.status_code != 200:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n")

    with client:
        check()


def test_health_polls_are_not_request_errors(serve: Callable[..., Served]) -> None:
    # Start-up: /health answers 503 until the nodes are up; a load balancer polls it. Those
    # polls used to count in pdserve:request_errors_total{reason="unavailable"}.
    not_ready = serve(nodes=NO_HEALTHY_PAIR)
    for _ in range(3):
        assert_error(httpx.get(f"{not_ready.url}/health"), 503, None)
    errors = not_ready.frontend.metrics.request_errors
    assert errors.labels(reason="unavailable")._value.get() == 0


def test_a_refusal_for_capacity_says_when_to_retry(serve: Callable[..., Served]) -> None:
    def script(request: GenerationRequest) -> list[Step]:
        return [GatewayError(ErrorKind.RESOURCE_EXHAUSTED, "every decode node is full")]

    served = serve(script)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "x", "stream": stream}
        response = served.post("/v1/completions", body)
        assert_error(response, 429, None)
        assert int(response.headers["retry-after"]) >= 1
    assert "retry-after" not in served.post("/v1/completions", {"model": 3}).headers


def test_a_stalled_body_is_answered_408(serve: Callable[..., Served]) -> None:
    served = serve(body_read_timeout_s=0.5)
    port = int(served.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        body = b'{"model": "' + MODEL.encode() + b'", "prompt": "x"}'
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        sock.sendall(head + body[:10])  # then nothing more
        reply = sock.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "the request body stalled" in reply
    # The server still serves everyone else.
    assert served.post("/v1/completions", {"model": MODEL, "prompt": "x"}).status_code == 200


def test_grammar_checks_do_not_stall_the_event_loop(
    serve: Callable[..., Served], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checking a request's grammar takes seconds for a large one (a Lark grammar of 60,000
    alternatives fits in the body limit); meanwhile the gateway must go on serving others."""
    served = serve()
    grammar = BlockingGrammarCheck(monkeypatch, wait_s=10)
    responses: list[httpx.Response] = []
    body = {"model": MODEL, "prompt": "x", "guided_choice": ["yes", "no"]}
    thread = threading.Thread(target=lambda: responses.append(served.post("/v1/completions", body)))
    thread.start()
    try:
        assert grammar.entered.wait(10)
        assert httpx.get(f"{served.url}/v1/models", timeout=5).status_code == 200
    finally:
        grammar.released.set()
        thread.join()
    assert grammar.was_released == [True]
    assert responses[0].status_code == 200
