"""vLLM's ``truncate_prompt_tokens`` on both APIs: the nodes get the prompt's last k tokens
(-1: ``max_model_len`` of them), echo shows what was kept, and a k of 0, below -1 or past
``max_model_len`` is refused naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.text.tokenizer import Tokenizer
from pdserve.v1 import gateway_pb2
from support.fake_gateway import FakeGateway
from support.openai_app import MODEL, Served, assert_error, start

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away."


@pytest.fixture(scope="module")
def served(tokenizer: Tokenizer) -> Iterator[Served]:
    served, server = start(tokenizer)  # max_model_len 256
    yield served
    server.stop()


def test_completions_keep_the_last_tokens(served: Served) -> None:
    ids = served.tokenizer.encode(PROMPT)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "truncate_prompt_tokens": 5}
    response = served.post("/v1/completions", {**body, "echo": True}).json()
    assert served.generator.requests[-1].prompt_token_ids == tuple(ids[-5:])
    assert response["usage"]["prompt_tokens"] == 5
    kept = served.tokenizer.decode(ids[-5:])
    assert response["choices"][0]["text"].startswith(kept)
    assert not response["choices"][0]["text"].startswith(PROMPT[:10])

    long_ids = list(range(10, 310))  # 300 tokens: past max_model_len 256
    served.post("/v1/completions", {**body, "prompt": long_ids, "truncate_prompt_tokens": 200})
    assert served.generator.requests[-1].prompt_token_ids == tuple(long_ids[-200:])
    # -1 keeps max_model_len tokens, which leaves no room for output: refused as vLLM does.
    refused = served.post(
        "/v1/completions", {**body, "prompt": long_ids, "truncate_prompt_tokens": -1}
    )
    assert_error(refused, 400, "prompt")


def test_chat_keeps_the_last_tokens(served: Served) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    served.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 2, "truncate_prompt_tokens": 7},
    )
    assert served.generator.requests[-1].prompt_token_ids == tuple(
        served.tokenizer.encode_chat(messages)[-7:]
    )


@pytest.mark.parametrize("keep", [0, -2, 257])
def test_bad_values_are_refused(served: Served, keep: int) -> None:
    before = len(served.generator.requests)
    body = {"model": MODEL, "prompt": PROMPT, "truncate_prompt_tokens": keep}
    assert_error(served.post("/v1/completions", body), 400, "truncate_prompt_tokens")
    assert len(served.generator.requests) == before


def test_grpc_keeps_the_last_tokens(tiny_llama_dir: Path) -> None:
    served = FakeGateway.start(tiny_llama_dir)
    try:
        ids = list(range(10, 60))
        request = gateway_pb2.GatewayGenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=ids), truncate_prompt_tokens=3
        )
        code, details, _ = served.call(request)
        assert code is grpc.StatusCode.OK, details
        assert served.node.prompts[-1] == ids[-3:]
        request.truncate_prompt_tokens = 0
        code, details, _ = served.call(request)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "truncate_prompt_tokens" in details
    finally:
        served.close()
