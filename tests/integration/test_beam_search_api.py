"""vLLM's ``use_beam_search`` through the gateway's HTTP API over real nodes: each prompt's ``n``
choices are the ``n`` beams the offline ``LLM.beam_search`` finds on the same model, whole and
streamed, disaggregated and colocated; the fields the search would not use are refused, named;
every node's blocks are free afterwards."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest

from services.engine import LLM, BeamSearchParams
from support.inprocess_stack import MAX_MODEL_LEN, Stack, run_stack

PROMPTS = [[5, 17, 300, 41, 9], [1000, 7, 7, 250]]
WIDTH, MAX_TOKENS = 3, 6


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> list[list[tuple[str, str]]]:
    """Per prompt, the offline search's beams as (text, finish reason), best first."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=8 << 20)
    tokenizer = llm.get_tokenizer()
    outputs = llm.beam_search(
        [{"prompt_token_ids": p} for p in PROMPTS],
        BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS),
    )
    return [
        [
            (
                tokenizer.decode(beam.output_token_ids, skip_special_tokens=True),
                str(beam.finish_reason),
            )
            for beam in output.sequences
        ]
        for output in outputs
    ]


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_use_beam_search_returns_the_offline_searchs_beams(
    tiny_llama_dir: Path, expected: list[list[tuple[str, str]]], colocated: bool
) -> None:
    async def body(stack: Stack) -> None:
        base_url = f"http://127.0.0.1:{stack.gateway.http_port}"
        request = {"prompt": PROMPTS, "n": WIDTH, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                   "use_beam_search": True}  # fmt: skip
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            response = await client.post("/v1/completions", json=request)
            assert response.status_code == 200, response.text
            choices = response.json()["choices"]
            got = [(c["text"], c["finish_reason"]) for c in choices]
            assert got == [beam for beams in expected for beam in beams]
            assert [c["index"] for c in choices] == list(range(len(PROMPTS) * WIDTH))
            # Streamed: the same choices, each whole once its prompt's search ended.
            texts = [""] * len(choices)
            async with client.stream(
                "POST", "/v1/completions", json={**request, "stream": True}
            ) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: {"):
                        for choice in httpx.Response(200, content=line[6:]).json()["choices"]:
                            texts[choice["index"]] += choice["text"]
            assert texts == [text for text, _ in got]
            # Chat: a conversation's n best beams.
            chat = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4,
                      "use_beam_search": True, "length_penalty": 0.5},
            )  # fmt: skip
            assert chat.status_code == 200, chat.text
            assert len(chat.json()["choices"]) == 2
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body, colocated=colocated)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": True, "n": 11}, "n"),  # 2 n logprobs a step, at most 20
        ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "echo": True}, "echo"),
        ({"use_beam_search": True, "guided_choice": ["a", "b"]}, "guided_choice"),
        ({"length_penalty": 2.0}, "length_penalty"),  # without the search
    ],
)
def test_fields_the_search_does_not_use_are_refused_by_name(
    tiny_llama_dir: Path, fields: dict[str, object], param: str
) -> None:
    async def body(stack: Stack) -> None:
        base_url = f"http://127.0.0.1:{stack.gateway.http_port}"
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            response = await client.post(
                "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, **fields}
            )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param

    run_stack(tiny_llama_dir, body, colocated=True)


def test_a_client_that_leaves_mid_search_leaves_no_blocks(tiny_llama_dir: Path) -> None:
    """The search's rounds stop with the client: no round outlives it, every block is freed."""

    async def body(stack: Stack) -> None:
        base_url = f"http://127.0.0.1:{stack.gateway.http_port}"
        request = {"prompt": PROMPTS[0], "n": 4, "max_tokens": 200, "ignore_eos": True,
                   "temperature": 0.0, "use_beam_search": True}  # fmt: skip
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            post = asyncio.create_task(client.post("/v1/completions", json=request))
            generated = stack.gateway.metrics.generation_tokens

            # Rounds are running once the nodes have produced tokens for them.
            while _count(generated) == 0:
                await asyncio.sleep(0.01)
            post.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await post
        started = _count(generated)
        await stack.wait_all_free()
        await asyncio.sleep(0.5)  # a round still running would produce tokens meanwhile
        assert _count(generated) - started <= 4  # at most the round in flight, one per beam
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body, colocated=True)


def _count(counter: object) -> float:
    """A prometheus counter's value, summed over its labels."""
    return sum(
        sample.value
        for metric in counter.collect()  # type: ignore[attr-defined]
        for sample in metric.samples
        if sample.name.endswith("_total")
    )
