"""A node compiles a constrained request's grammar off its engine thread and event loop: a large
grammar takes seconds (a Lark grammar of 60,000 alternatives: ~5 s), and meanwhile
the node must go on serving its other requests, on a decode node's reservation path
(``kv_source``) as on the path that computes the prompt itself (colocated, prefill, recompute).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from support.blocking_grammar import BlockingGrammarCheck
from support.inprocess_stack import GREEDY, Stack, node_channel, run_stack

GUIDED = common_pb2.SamplingParams(
    max_tokens=8,
    guided=common_pb2.GuidedDecoding(kind=common_pb2.GUIDED_KIND_CHOICE, spec='["yes", "no"]'),
)


@pytest.mark.parametrize("kv_source", ["", "prefill-x"], ids=["computed-here", "reserved"])
def test_a_grammar_compile_does_not_stall_the_node(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, kv_source: str
) -> None:
    # Runs wherever the node compiles; a compile on the engine thread would block the other
    # request's steps below, and the wait would end only by its time-out.
    grammar = BlockingGrammarCheck(monkeypatch, wait_s=20)

    async def body(stack: Stack) -> None:
        server, _ = stack.nodes["decode0"]
        async with node_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            constrained = stub.Generate(
                decode_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7], sampling=GUIDED, kv_source=kv_source,
                    lease_ms=30_000,
                ),
                timeout=60,
            )  # fmt: skip
            first = asyncio.ensure_future(constrained.read())
            try:
                assert await asyncio.to_thread(grammar.entered.wait, 20)
                other = decode_pb2.GenerateRequest(prompt_token_ids=[9] * 20, sampling=GREEDY)
                events = [event async for event in stub.Generate(other, timeout=60)]
                assert events[-1].finished.usage.completion_tokens == 8
            finally:
                grammar.released.set()
            event = await first
            assert event.WhichOneof("event") == ("reservation" if kv_source else "tokens")
            constrained.cancel()
        assert grammar.was_released == [True]
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)


def test_a_grammar_the_node_cannot_compile_is_invalid_argument(tiny_llama_dir: Path) -> None:
    """The compile's refusal still reaches the caller, from the compile pool."""
    bad = common_pb2.SamplingParams(
        max_tokens=8,
        guided=common_pb2.GuidedDecoding(kind=common_pb2.GUIDED_KIND_REGEX, spec="(unclosed"),
    )

    async def body(stack: Stack) -> None:
        server, _ = stack.nodes["decode0"]
        async with node_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            for kv_source in ("", "prefill-x"):
                request = decode_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7], sampling=bad, kv_source=kv_source
                )
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    async for _ in stub.Generate(request, timeout=60):
                        pass
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "guided.regex" in error.value.details()
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)
