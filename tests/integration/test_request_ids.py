"""A client's request id is the client's label, never the nodes' key: requests that send the
same id (``X-Request-Id`` on the OpenAI bridge, ``request_id`` on the gRPC API) at once, one
after another, or while the first's KV is still being pushed, each get exactly the tokens they
get alone, and every response still shows the client's id (as vLLM does).

The stack is the in-process one of ``test_gateway.py``: a prefill node, two decode nodes, KV
moved by the loopback transport, a gateway in front.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.v1 import common_pb2
from services.engine import LLM, SamplingParams
from support.inprocess_stack import MAX_MODEL_LEN, Stack, run_stack

CLIENT_ID = "client-chosen-id.1"


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Four prompts and the single-process engine's greedy tokens for each, alone."""
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in (24, 37, 51, 66)]
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return prompts, [list(o.token_ids) for o in offline.generate(prompts, params)]


async def complete(stack: Stack, prompt: list[int], request_id: str) -> httpx.Response:
    body = {
        "model": stack.gateway.frontend.served_model_name,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    base = f"http://127.0.0.1:{stack.gateway.http_port}"
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        return await http.post("/v1/completions", json=body, headers={"X-Request-Id": request_id})


def assert_served(stack: Stack, response: httpx.Response, tokens: list[int]) -> None:
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == CLIENT_ID
    body = response.json()
    assert body["id"] == CLIENT_ID
    assert body["choices"][0]["text"] == stack.gateway.frontend.tokenizer.decode(tokens)
    assert body["usage"]["completion_tokens"] == 8


def test_concurrent_openai_requests_with_one_x_request_id(tiny_llama_dir: Path, expected) -> None:
    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        responses = await asyncio.gather(*(complete(stack, p, CLIENT_ID) for p in prompts))
        for response, ids in zip(responses, tokens, strict=True):
            assert_served(stack, response, ids)
        # The id again, each request after the last finished (a client's retry).
        for prompt, ids in zip(prompts[:2], tokens[:2], strict=True):
            assert_served(stack, await complete(stack, prompt, CLIENT_ID), ids)
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)


def test_concurrent_grpc_requests_with_one_request_id_and_bad_ids(
    tiny_llama_dir: Path, expected
) -> None:
    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        results = await asyncio.gather(
            *(stack.generate(p, request_id=CLIENT_ID) for p in prompts[:3])
        )
        for (ids, _, finished), want in zip(results, tokens[:3], strict=True):
            assert ids == want
            assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert finished.request_id == CLIENT_ID
        # The id reaches log lines and the nodes' ids: the HTTP header's rules hold here too.
        for bad in ("x" * 129, "two words", "é"):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stack.generate(prompts[0], request_id=bad)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request_id" in error.value.details()
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)


def test_an_id_reused_while_the_first_requests_kv_is_in_flight(
    tiny_llama_dir: Path, expected
) -> None:
    """The prefill node pauses each push: the second request, with the first's id, arrives
    while the first's prompt KV is held on the prefill node and reserved on a decode node."""
    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        _, prefill_engine = stack.nodes["prefill"]
        first = asyncio.ensure_future(complete(stack, prompts[0], CLIENT_ID))
        for _ in range(3000):
            if await prefill_engine.call(lambda core: bool(core.scheduler.held)):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the first request's KV was never held for its push")
        assert not first.done()
        second = await complete(stack, prompts[1], CLIENT_ID)
        assert_served(stack, await first, tokens[0])
        assert_served(stack, second, tokens[1])
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body, prefill_extra=("--test-kv-push-pause-s", "1"))
