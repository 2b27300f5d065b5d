"""The gateway against fake nodes (tests/support/fake_node.py, no model) scripted to fail: what a
client of the public gRPC API sees for each failure, and when the gateway retries."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest

from gateway.config import parse_gateway_config
from gateway.server import GatewayServer
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


async def start_fake(fake_node, role: str, **script) -> tuple[grpc.aio.Server, str]:
    args = argparse.Namespace(
        role=role, port=0, ttft_ms=0.0, itl_ms=0.0, fail_after_tokens=None, refuse=False
    )
    vars(args).update(script)
    server = grpc.aio.server()
    node = fake_node.FakeNode(args)
    fake_node.prefill_pb2_grpc.add_PrefillServiceServicer_to_server(node, server)
    fake_node.decode_pb2_grpc.add_DecodeServiceServicer_to_server(node, server)
    health = fake_node.health.aio.HealthServicer()
    fake_node.health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def run(fake_node, body, prefill=(), decode=(), colocated=(), extra=()) -> None:
    """Each node argument is a list of scripts (dicts of fake_node flags)."""

    async def main() -> None:
        nodes = {"prefill": [], "decode": [], "colocated": []}
        servers = []
        for role, scripts in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
            for script in scripts:
                server, address = await start_fake(fake_node, role, **script)
                servers.append(server)
                nodes[role].append(address)
        flags = [f"--{role}={','.join(a)}" for role, a in nodes.items() if a]
        config = parse_gateway_config(
            ["--model", str(body.model_dir), "--host", "127.0.0.1", "--http-port", "0",
             "--grpc-port", "0", "--max-model-len", "512", "--health-interval-s", "60",
             *flags, *extra],
            {},
        )  # fmt: skip
        gateway = GatewayServer(config)
        await gateway.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
                await body(gateway_pb2_grpc.GatewayServiceStub(channel), gateway)
        finally:
            await gateway.stop(grace_s=0.5)
            for server in servers:
                await server.stop(0)

    asyncio.run(main())


async def collect(stub, max_tokens: int = 6):
    request = gateway_pb2.GatewayGenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )
    tokens, finished = [], None
    async for event in stub.Generate(request, timeout=20):
        if event.WhichOneof("event") == "delta":
            tokens.extend(event.delta.token_ids)
        else:
            finished = event.finished
    return tokens, finished


def with_model(tiny_llama_dir, fn):
    fn.model_dir = tiny_llama_dir
    return fn


def test_fake_pair_streams_every_token(fake_node, tiny_llama_dir) -> None:
    async def body(stub, gateway) -> None:
        tokens, finished = await collect(stub)
        assert tokens == [7, 8, 9, 10, 11, 12]  # first from the prefill fake, rest from decode
        assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH

    run(fake_node, with_model(tiny_llama_dir, body), prefill=[{}], decode=[{}])


def test_a_failure_after_tokens_ends_the_stream_with_error(fake_node, tiny_llama_dir) -> None:
    async def body(stub, gateway) -> None:
        tokens, finished = await collect(stub)
        # Token 1 from the prefill, 2..3 from the decode, then the decode node breaks: the
        # client gets what was sent and a clear error, never a silent truncation or a retry.
        assert tokens == [7, 8, 9]
        assert finished.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert "fake node: failed" in finished.error
        assert not finished.invalid_request  # the node's failure, not the request's
        assert finished.num_retries == 0

    run(
        fake_node,
        with_model(tiny_llama_dir, body),
        prefill=[{}],
        # 30 ms between tokens: the decode breaks well after the prefill's reply reached the
        # gateway. (Breaking before it is a failure before any token, rightly retried.)
        decode=[{"fail_after_tokens": 3, "itl_ms": 30}, {"fail_after_tokens": 3, "itl_ms": 30}],
    )


def test_when_every_decode_is_full_the_request_waits_for_room(fake_node, tiny_llama_dir) -> None:
    async def body(stub, gateway) -> None:
        tokens, finished = await collect(stub)
        assert len(tokens) == 6 and finished.num_retries == 2
        assert gateway.metrics.retries.labels(cause="decode_full")._value.get() == 2

    run(fake_node, with_model(tiny_llama_dir, body), prefill=[{}],
        decode=[{"refuse_unless_waiting": True}, {"refuse_unless_waiting": True}])  # fmt: skip


def test_refusals_are_retried_then_reported_as_exhausted(fake_node, tiny_llama_dir) -> None:
    async def body(stub, gateway) -> None:
        tokens, finished = await collect(stub)
        assert len(tokens) == 6 and finished.num_retries == 1

    run(fake_node, with_model(tiny_llama_dir, body), prefill=[{}],
        decode=[{"refuse": True}, {}])  # fmt: skip

    async def all_full(stub, gateway) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Both decodes refused, then one refused even to queue the request (its wait queue is
        # full): only then is the client told, before any node did work for it.
        assert gateway.metrics.retries.labels(cause="decode_full")._value.get() == 3

    run(fake_node, with_model(tiny_llama_dir, all_full), prefill=[{}],
        decode=[{"refuse": True}, {"refuse": True}])  # fmt: skip


def test_deadlines_before_and_after_the_first_token(fake_node, tiny_llama_dir) -> None:
    async def slow_first(stub, gateway) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    run(fake_node, with_model(tiny_llama_dir, slow_first), colocated=[{"ttft_ms": 3000}],
        extra=["--request-timeout-s", "0.3"])  # fmt: skip

    async def slow_tokens(stub, gateway) -> None:
        tokens, finished = await collect(stub, max_tokens=50)
        assert 1 <= len(tokens) < 50
        assert finished.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert "deadline" in finished.error

    run(fake_node, with_model(tiny_llama_dir, slow_tokens), colocated=[{"itl_ms": 100}],
        extra=["--request-timeout-s", "0.5"])  # fmt: skip


def test_no_healthy_node_is_unavailable(fake_node, tiny_llama_dir) -> None:
    async def body(stub, gateway) -> None:
        for node in gateway.pool.nodes:
            node.mark_failed("test")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE

    run(fake_node, with_model(tiny_llama_dir, body), colocated=[{}])


def test_a_poll_reports_the_nodes_that_came_back(fake_node, tiny_llama_dir) -> None:
    async def body(stub, gateway) -> None:
        [node] = gateway.pool.nodes
        assert await gateway.pool.poll_once() == []  # healthy before and after
        node.mark_failed("a request saw it unreachable")
        assert await gateway.pool.poll_once() == [node]  # back: its affinity will be dropped
        assert node.is_healthy
        assert await gateway.pool.poll_once() == []

    run(fake_node, with_model(tiny_llama_dir, body), colocated=[{}])
