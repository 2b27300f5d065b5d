"""Speculative decoding behind the gateway (nodes over real gRPC in this process): decode and
colocated nodes started with ``--speculative-config`` stream every kept token, the text of
several tokens a delta, and the tokens one engine without speculation produces."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pdserve.v1 import common_pb2
from services.engine import LLM, SamplingParams
from support.inprocess_stack import MAX_MODEL_LEN, Stack, run_stack

FLAGS = (
    "--speculative-config",
    json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
            "prompt_lookup_min": 1,
        }
    ),  # fmt: skip
)
# Repeated cycles: the tiny model's greedy text continues some of them.
PROMPTS = [[3, 4] * 15, [9, 10, 11, 12] * 5, [300, 301, 302] * 8]
SAMPLING = common_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> list[list[int]]:
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in offline.generate(PROMPTS, params)]


async def check(stack: Stack, expected: list[list[int]], speculating: list[str]) -> None:
    results = await asyncio.gather(*(stack.generate(p, SAMPLING) for p in PROMPTS))
    assert [tokens for tokens, _, _ in results] == expected
    for (_, text, finished), ids in zip(results, expected, strict=True):
        assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert finished.usage.completion_tokens == 24
        assert text == stack.gateway.frontend.tokenizer.decode(ids)
    kept = 0
    for name in speculating:
        _, engine = stack.nodes[name]
        kept += (await engine.call(lambda core: core.stats())).num_accepted_tokens_total
    assert kept > 0, "no node kept a proposal"
    await stack.wait_all_free()


def test_decode_nodes_that_speculate_stream_the_single_engines_tokens(
    tiny_llama_dir: Path, expected: list[list[int]]
) -> None:
    async def body(stack: Stack) -> None:
        await check(stack, expected, ["decode0", "decode1"])

    run_stack(tiny_llama_dir, body, decode_extra=FLAGS)


def test_a_colocated_node_that_speculates_streams_the_single_engines_tokens(
    tiny_llama_dir: Path, expected: list[list[int]]
) -> None:
    async def body(stack: Stack) -> None:
        await check(stack, expected, ["colocated"])

    run_stack(tiny_llama_dir, body, colocated=True, node_extra=FLAGS)
