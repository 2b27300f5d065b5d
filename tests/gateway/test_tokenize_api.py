"""vLLM's ``/tokenize`` and ``/detokenize`` on the gateway: the token ids are the ones a
completion or chat request becomes (the same tokenizer and template calls), bad input is a 400
or 404 naming the field, and the API key guards both as it guards ``/v1``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gateway.admission import Admission
from gateway.text.tokenizer import Tokenizer
from support.openai_app import MODEL, Served, assert_error, start, wait_until

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(tokenizer: Tokenizer) -> Iterator[Served]:
    served, server = start(tokenizer)
    yield served
    server.stop()


def test_a_prompt_tokenizes_as_a_completion_request_would(served: Served) -> None:
    tokenizer = served.tokenizer
    body = served.post("/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    expected = tokenizer.encode("Hello world")
    assert body == {"count": len(expected), "max_model_len": 256, "tokens": expected,
                    "token_strs": None}  # fmt: skip
    # ... which is what the completions route hands the generator.
    served.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=1)
    assert list(served.generator.requests[-1].prompt_token_ids) == expected

    plain = served.post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert plain.json()["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert len(expected) == len(plain.json()["tokens"]) + 1  # the BOS

    pieces = served.post("/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert pieces["token_strs"] == [tokenizer.backend.id_to_token(t) for t in expected]


def test_a_chat_tokenizes_as_a_chat_request_would(served: Served) -> None:
    body = served.post("/tokenize", {"messages": MESSAGES}).json()
    served.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    assert body["tokens"] == list(served.generator.requests[-1].prompt_token_ids)
    assert body["count"] == len(body["tokens"])

    continued = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    body = served.post("/tokenize", {"messages": continued, **options}).json()
    assert body["tokens"] == served.tokenizer.encode_chat(continued, **options)
    assert served.tokenizer.decode(body["tokens"]).endswith("It is")


def test_detokenize_inverts_tokenize(served: Served) -> None:
    tokens = served.post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    body = served.post("/detokenize", {"model": MODEL, "tokens": tokens.json()["tokens"]}).json()
    assert body == {"prompt": "Hello world"}
    assert served.post("/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
        # The field as the client spelled it, not the name of the request class tried.
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "temperature": 1}, 400, "temperature"),
        ("/tokenize", {"messages": []}, 400, "messages"),  # a chat's error, not a prompt's
        ("/tokenize", {"messages": MESSAGES, "prompt": "x"}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
        (
            "/tokenize",
            {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}},
            400,
            "chat_template_kwargs",
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "gpt-9"}, 404, "model"),
    ],
)
def test_bad_input_is_a_client_error(
    served: Served, path: str, body: dict[str, object], status: int, param: str | None
) -> None:
    response = served.post(path, body)
    error = assert_error(response, status, response.json()["error"]["param"])
    if param is not None:
        assert error["param"] == param, error


def test_a_lone_surrogate_names_the_prompt(served: Served) -> None:
    response = httpx.post(
        f"{served.url}/tokenize",
        content=b'{"prompt": "\\ud800"}',
        headers={"content-type": "application/json"},
    )
    error = assert_error(response, 400, "prompt")
    assert error["message"].startswith("prompt: ") and "surrogate" in error["message"]
    assert_error(served.post("/tokenize", []), 400, None)  # not an object: no field to name


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        ([{"role": "function", "content": "x"}], "messages[0].role"),
    ],
)
def test_messages_are_checked_as_the_chat_route_checks_them(
    served: Served, messages: list[dict[str, Any]], param: str
) -> None:
    """The same messages get the same 400 from both routes, not a count from one."""
    tokenized = assert_error(served.post("/tokenize", {"messages": messages}), 400, param)
    chat = served.post("/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert assert_error(chat, 400, param) == tokenized


def test_the_api_key_guards_both(tokenizer: Tokenizer) -> None:
    served, server = start(tokenizer, api_keys=("sesame",))
    try:
        assert_error(served.post("/tokenize", {"prompt": "x"}), 401, None)
        assert_error(served.post("/detokenize", {"tokens": [1]}), 401, None)
        key = {"Authorization": "Bearer sesame"}
        assert served.post("/tokenize", {"prompt": "x"}, headers=key).status_code == 200
        assert served.post("/detokenize", {"tokens": [1]}, headers=key).status_code == 200
    finally:
        server.stop()


def test_tools_are_checked_as_the_chat_route_checks_them(served: Served) -> None:
    body = {
        "messages": MESSAGES,
        "tools": [{"type": "function", "function": {"name": "no spaces"}}],
    }
    assert_error(served.post("/tokenize", body), 400, "tools[0]")
    good = {"type": "function", "function": {"name": "get_weather"}}
    assert served.post("/tokenize", {"messages": MESSAGES, "tools": [good]}).status_code == 200


class HeldTokenizer:
    """The tokenizer, with ``encode`` held until ``release`` is set."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        self.entered.release()
        self.release.wait(10)
        return self._tokenizer.encode(*args, **kwargs)


def test_tokenizer_calls_are_bounded_apart_from_generations(tokenizer: Tokenizer) -> None:
    held = HeldTokenizer(tokenizer)
    served, server = start(held, tokenizer_admission=Admission(1, 1))  # type: ignore[arg-type]
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(served.post, "/tokenize", {"prompt": "one"})
            assert held.entered.acquire(timeout=5)  # the one slot is taken
            second = pool.submit(served.post, "/tokenize", {"prompt": "two"})
            wait_until(lambda: served.frontend.tokenizer_admission.num_queued == 1)
            # The queue is full: refused at once, for both routes, with a time to retry.
            refused = served.post("/tokenize", {"prompt": "three"})
            assert_error(refused, 429, None)
            assert int(refused.headers["retry-after"]) >= 1
            assert_error(served.post("/detokenize", {"tokens": [5, 6]}), 429, None)
            # Generations have their own bound: a prompt of token ids needs no tokenizer call.
            done = served.client().completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1)
            assert done.choices[0].text
            held.release.set()
            answers = [first.result(timeout=10).json(), second.result(timeout=10).json()]
        assert [a["tokens"] for a in answers] == [tokenizer.encode(t) for t in ("one", "two")]
        assert served.post("/detokenize", {"tokens": [5, 6]}).status_code == 200
    finally:
        held.release.set()
        server.stop()
