"""Logprobs in the OpenAI formats, over a fake node that sends them as the engine does: each
token's top-n alternatives with the token itself added in its place when it is not among them,
and prompt tokens' ranks in the vocabulary. The legacy completions format shows up to n + 1 per
token, with text offsets into the whole choice text (echoed prompt included); chat shows exactly
the top n; vLLM's ``prompt_logprobs`` gives every entry its rank."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.generation import Finished, GenerationRequest, TokenChunk
from gateway.text.tokenizer import Tokenizer
from services.types import FinishReason, TokenLogprob, Usage
from support.openai_app import MODEL, OUTPUT_TEXT, Script, Served, Step, sse_chunks, start

OWN_RANK = 3
"""Every token's rank: two alternatives are more likely than the token the node sends."""


def ranked(token_id: int) -> list[tuple[int, float]]:
    """The vocabulary around ``token_id`` as the fake model sees it, best first."""
    return [
        (token_id + 1, -0.5), (token_id + 2, -1.0), (token_id, -1.25), (token_id + 3, -1.5),
        (token_id + 4, -2.0),
    ]  # fmt: skip


def engine_logprob(token_id: int, num_top: int, rank: int | None = None) -> TokenLogprob:
    """What a node sends for ``token_id`` asked for ``num_top`` alternatives."""
    top = ranked(token_id)[:num_top]
    if token_id not in dict(top):
        top.append((token_id, -1.25))
    return TokenLogprob(token_id, -1.25, tuple(top), rank)


def engine_script(tokenizer: Tokenizer) -> Script:
    output_ids = tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)

    def script(request: GenerationRequest) -> list[Step]:
        sampling = request.sampling
        steps: list[Step] = []
        for index, token_id in enumerate(output_ids[: sampling.max_tokens]):
            logprobs = None
            if sampling.logprobs is not None:
                logprobs = (engine_logprob(token_id, sampling.logprobs),)
            prompt = None
            if index == 0 and sampling.prompt_logprobs is not None:
                prompt = tuple(
                    engine_logprob(t, sampling.prompt_logprobs, rank=OWN_RANK)
                    for t in request.prompt_token_ids[1:]
                )
            steps.append(TokenChunk((token_id,), logprobs, prompt))
        num_tokens = min(sampling.max_tokens, len(output_ids))
        steps.append(
            Finished(FinishReason.LENGTH, Usage(len(request.prompt_token_ids), num_tokens))
        )
        return steps

    return script


@pytest.fixture
def served(tokenizer: Tokenizer) -> Iterator[Served]:
    served, server = start(tokenizer, engine_script(tokenizer))
    yield served
    server.stop()


def by_id(token_id: int) -> str:
    return f"token_id:{token_id}"  # as return_tokens_as_token_ids names tokens


def streamed_choices(served: Served, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream(
        "POST", f"{served.url}{path}", json={**body, "stream": True}, timeout=10
    ) as response:
        response.read()
    assert response.status_code == 200, response.text
    return [choice for chunk in sse_chunks(response) for choice in chunk["choices"]]


# --- legacy completions: text offsets --------------------------------------------------------


@pytest.mark.parametrize("echo", [True, False])
def test_streamed_text_offsets_index_the_whole_choice_text(served: Served, echo: bool) -> None:
    prompt = "Hello, my name is"
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": echo,
        "logprobs": 0, "n": 2,
    }  # fmt: skip
    response = served.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    whole = {choice["index"]: choice for choice in response.json()["choices"]}

    texts = {0: "", 1: ""}
    offsets: dict[int, list[int]] = {0: [], 1: []}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    for choice in streamed_choices(served, "/v1/completions", body):
        texts[choice["index"]] += choice["text"]
        if choice["logprobs"] is not None:
            offsets[choice["index"]] += choice["logprobs"]["text_offset"]
            tokens[choice["index"]] += choice["logprobs"]["tokens"]

    output_ids = served.tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:4]
    generated = [served.tokenizer.token_text(t) for t in output_ids]
    echoed = prompt if echo else ""
    expected = [len(echoed) + len("".join(generated[:k])) for k in range(4)]
    for index in (0, 1):
        assert texts[index] == whole[index]["text"] == echoed + "".join(generated)
        assert offsets[index] == whole[index]["logprobs"]["text_offset"]
        assert tokens[index][-4:] == generated
        assert offsets[index][-4:] == expected
        for offset, token in zip(offsets[index][-4:], generated, strict=True):
            assert texts[index][offset : offset + len(token)] == token


# --- how many alternatives each format shows ----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("top_logprobs", [None, 0, 1, 2, 4])
def test_chat_top_logprobs_holds_exactly_the_top_n(
    served: Served, top_logprobs: int | None, stream: bool
) -> None:
    body: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "logprobs": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    if top_logprobs is not None:
        body["top_logprobs"] = top_logprobs
    if stream:
        choices = streamed_choices(served, "/v1/chat/completions", body)
    else:
        response = served.post("/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
    content = [entry for c in choices if c.get("logprobs") for entry in c["logprobs"]["content"]]

    output_ids = served.tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:3]
    assert [entry["token"] for entry in content] == [by_id(t) for t in output_ids]
    for entry, token_id in zip(content, output_ids, strict=True):
        assert entry["logprob"] == -1.25
        # The sampled token, third most likely, is among them only when 3 or more are asked.
        assert [(top["token"], top["logprob"]) for top in entry["top_logprobs"]] == [
            (by_id(t), value) for t, value in ranked(token_id)[: top_logprobs or 0]
        ]


@pytest.mark.parametrize("num_top", [0, 1, 3])
def test_legacy_top_logprobs_add_the_sampled_token_to_the_top_n(
    served: Served, num_top: int
) -> None:
    body = {
        "model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": num_top,
        "return_tokens_as_token_ids": True,
    }  # fmt: skip
    logprobs = served.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    output_ids = served.tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False)[:3]
    for top, token_id in zip(logprobs["top_logprobs"], output_ids, strict=True):
        expected = dict(ranked(token_id)[:num_top])
        expected[token_id] = -1.25
        assert top == {by_id(t): value for t, value in expected.items()}


def test_an_echoed_prompt_shows_logprobs_alternatives_not_prompt_logprobs(
    served: Served,
) -> None:
    # The nodes are asked for max(logprobs, prompt_logprobs) alternatives per prompt token;
    # the echoed legacy logprobs show `logprobs` of them, the prompt_logprobs field its own.
    body = {
        "model": MODEL, "prompt": "Hello, my name is", "max_tokens": 2, "echo": True,
        "logprobs": 1, "prompt_logprobs": 3, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    choice = served.post("/v1/completions", body).json()["choices"][0]
    assert served.generator.requests[-1].sampling.prompt_logprobs == 3
    prompt_ids = served.generator.requests[-1].prompt_token_ids
    echoed_top = choice["logprobs"]["top_logprobs"][: len(prompt_ids)]
    assert echoed_top[0] is None
    for top, token_id in zip(echoed_top[1:], prompt_ids[1:], strict=True):
        assert top == {by_id(token_id + 1): -0.5, by_id(token_id): -1.25}
    for entry, token_id in zip(choice["prompt_logprobs"][1:], prompt_ids[1:], strict=True):
        assert {int(t): v["rank"] for t, v in entry.items()} == {
            token_id + 1: 1,
            token_id + 2: 2,
            token_id: OWN_RANK,
        }


# --- prompt_logprobs: ranks -------------------------------------------------------------------


@pytest.mark.parametrize("num_top", [0, 1, 2, 4])
def test_the_prompt_token_has_its_rank_in_the_vocabulary(served: Served, num_top: int) -> None:
    """vLLM's rank of the prompt's own token is its true rank, asked for among the top n or
    not; the alternatives are ranked by place."""

    def check(field: list[dict[str, Any] | None], prompt_ids: tuple[int, ...]) -> None:
        assert field[0] is None and len(field) == len(prompt_ids)
        for entry, token_id in zip(field[1:], prompt_ids[1:], strict=True):
            assert entry is not None
            expected = {t: place for place, (t, _) in enumerate(ranked(token_id)[:num_top], 1)}
            expected[token_id] = OWN_RANK
            assert {int(t): v["rank"] for t, v in entry.items()} == expected
            assert entry[str(token_id)]["logprob"] == -1.25

    completion = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 2}
    body = {**completion, "prompt_logprobs": num_top}
    response = served.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    prompt_ids = served.generator.requests[-1].prompt_token_ids
    check(response.json()["choices"][0]["prompt_logprobs"], prompt_ids)
    first = next(iter(streamed_choices(served, "/v1/completions", body)))
    check(first["prompt_logprobs"], prompt_ids)

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = served.post("/v1/chat/completions", {**chat, "prompt_logprobs": num_top})
    assert response.status_code == 200, response.text
    check(response.json()["prompt_logprobs"], served.generator.requests[-1].prompt_token_ids)
