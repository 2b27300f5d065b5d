"""The gateway when a node hangs or dies under its requests.

A hung node (SIGSTOP: the process alive, its TCP connection open, no answer) is
tests/support/fake_node.py in a process of its own; the gateway and the other fake nodes run in
the test's event loop. The legs open on a hung node end once its health polls have gone
unanswered a few times in a row, as a killed node's end at once: a stream with an error, an
attempt before its first token with a retry. A node that is merely slow keeps its streams, and a
node that answers NOT_SERVING (draining) keeps its legs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc

from deploy.local_ports import free_ports
from gateway.config import KvFailurePolicy, RouterConfig, parse_gateway_config
from gateway.generation import GenerationRequest
from gateway.metrics import GatewayMetrics
from gateway.routing.grpc_legs import GrpcLegs
from gateway.routing.legs import RetryableFailure
from gateway.routing.node import MAX_UNANSWERED_POLLS, Node, NodeLoad
from gateway.routing.node_pool import NodePool
from gateway.server import GatewayServer
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, kv_pb2
from services.types import Role, SamplingParams
from support.fake_node import FakeNode, in_process_args, serve_in_process

FAKE_NODE = Path(__file__).resolve().parents[1] / "support" / "fake_node.py"
HEALTH_INTERVAL_S = 0.1
HEALTH_TIMEOUT_S = 0.5
# A hung node's legs end after MAX_UNANSWERED_POLLS polls that each waited out their timeout;
# the rest is room for a busy 2-core host. Without the polls, gRPC's ping timeout would end such
# streams after 20 s (60 s before node_client set it): the bound tells the two apart.
ENDED_WITHIN_S = MAX_UNANSWERED_POLLS * (HEALTH_TIMEOUT_S + HEALTH_INTERVAL_S) + 8


@contextlib.contextmanager
def node_process(role: str, *flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A fake node in a process of its own (which a test may stop), serving once this yields."""
    port = free_ports(1)[0]
    process = subprocess.Popen(
        [sys.executable, str(FAKE_NODE), "--role", role, "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith(f"fake {role} node on"), "it did not start"
        yield process, f"127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


@contextlib.asynccontextmanager
async def gateway_on(
    model_dir: Path, prefill: list[str], decode: list[str]
) -> AsyncIterator[tuple[GatewayServer, gateway_pb2_grpc.GatewayServiceStub]]:
    """A gateway that polls its nodes every ``HEALTH_INTERVAL_S``, and a client of its gRPC API."""
    config = parse_gateway_config(
        ["--model", str(model_dir), "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
         "--max-model-len", "512", "--health-interval-s", str(HEALTH_INTERVAL_S),
         f"--prefill={','.join(prefill)}", f"--decode={','.join(decode)}"],
        {},
    )  # fmt: skip
    router = dataclasses.replace(config.router, health_timeout_s=HEALTH_TIMEOUT_S)
    gateway = GatewayServer(dataclasses.replace(config, router=router))
    await gateway.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
            yield gateway, gateway_pb2_grpc.GatewayServiceStub(channel)
    finally:
        await gateway.stop(grace_s=0.5)


def generate(stub: gateway_pb2_grpc.GatewayServiceStub, prompt: list[int], max_tokens: int):
    request = gateway_pb2.GatewayGenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )
    return stub.Generate(request, timeout=120)


async def collect(stub, prompt: list[int], max_tokens: int) -> tuple[list[int], object]:
    tokens, finished = [], None
    async for event in generate(stub, prompt, max_tokens):
        if event.WhichOneof("event") == "delta":
            tokens.extend(event.delta.token_ids)
        else:
            finished = event.finished
    return tokens, finished


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def test_a_hung_decode_node_ends_its_streams_with_an_error(tiny_llama_dir: Path) -> None:
    async def main() -> None:
        prefill_server, prefill = await serve_in_process(FakeNode(in_process_args("prefill")))
        try:
            with node_process("decode", "--itl-ms", "20") as (process, decode):
                async with gateway_on(tiny_llama_dir, [prefill], [decode]) as (gateway, stub):
                    tokens: list[int] = []
                    finished = None
                    async with asyncio.timeout(None) as deadline:
                        async for event in generate(stub, [5, 6, 7], max_tokens=500):
                            if event.WhichOneof("event") == "finished":
                                finished = event.finished
                                continue
                            tokens.extend(event.delta.token_ids)
                            if len(tokens) >= 3 and deadline.when() is None:
                                process.send_signal(signal.SIGSTOP)
                                deadline.reschedule(asyncio.get_running_loop().time()
                                                    + ENDED_WITHIN_S)  # fmt: skip
                    # Ended as a killed node's stream ends: what was sent, then a clear error.
                    assert 3 <= len(tokens) < 500
                    assert finished is not None
                    assert finished.finish_reason == common_pb2.FINISH_REASON_ERROR
                    assert f"decode node {decode}" in finished.error
                    assert "health poll" in finished.error, finished.error
                    [node] = gateway.pool.decode
                    assert node.num_in_flight == 0

                    process.send_signal(signal.SIGCONT)  # it answers again: routed to again
                    await wait_until(lambda: node.is_healthy)
                    tokens, finished = await collect(stub, [8, 9], max_tokens=4)
                    assert len(tokens) == 4
                    assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        finally:
            await prefill_server.stop(0)

    asyncio.run(main())


def test_a_hung_prefill_node_is_retried_before_the_first_token(tiny_llama_dir: Path) -> None:
    async def main() -> None:
        servers = []
        try:
            addresses = []
            for role in ("prefill", "decode"):
                server, address = await serve_in_process(FakeNode(in_process_args(role)))
                servers.append(server)
                addresses.append(address)
            prefill, decode = addresses
            # Listed first, so an idle pair's request goes to it; it would answer in a minute.
            with node_process("prefill", "--ttft-ms", "60000") as (process, hung):
                async with gateway_on(tiny_llama_dir, [hung, prefill], [decode]) as (gateway, stub):
                    answer = asyncio.create_task(collect(stub, [11, 12, 13], max_tokens=6))
                    await wait_until(lambda: gateway.pool.prefill[0].num_in_flight == 1)
                    process.send_signal(signal.SIGSTOP)
                    tokens, finished = await asyncio.wait_for(answer, ENDED_WITHIN_S)
                    assert len(tokens) == 6
                    assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
                    assert finished.num_retries == 1
                    assert (
                        gateway.metrics.retries.labels(cause="prefill_unresponsive")._value.get()
                        == 1
                    )
                    assert all(node.num_in_flight == 0 for node in gateway.pool.nodes)
        finally:
            for server in servers:
                await server.stop(0)

    asyncio.run(main())


def test_a_slow_node_keeps_its_streams(tiny_llama_dir: Path) -> None:
    """Tokens further apart than the health polls' timeout: the node answers its polls."""

    async def main() -> None:
        servers, addresses = [], []
        for role, flags in (("prefill", {}), ("decode", {"itl_ms": 1000 * HEALTH_TIMEOUT_S * 1.5})):
            server, address = await serve_in_process(FakeNode(in_process_args(role, **flags)))
            servers.append(server)
            addresses.append(address)
        try:
            async with gateway_on(tiny_llama_dir, addresses[:1], addresses[1:]) as (_, stub):
                tokens, finished = await collect(stub, [21, 22], max_tokens=4)
                assert len(tokens) == 4
                assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        finally:
            for server in servers:
                await server.stop(0)

    asyncio.run(main())


def test_the_legs_end_only_after_several_polls_in_a_row_went_unanswered() -> None:
    node = Node("127.0.0.1:1", Role.DECODE)
    ended: list[str] = []
    node.add_leg(ended.append)
    node.observe_poll(NodeLoad(), None)
    for _ in range(MAX_UNANSWERED_POLLS - 1):
        node.observe_poll(None, "DEADLINE_EXCEEDED: Deadline Exceeded")
    node.observe_poll(NodeLoad(), None)  # answered: the count starts again
    for _ in range(MAX_UNANSWERED_POLLS - 1):
        node.observe_poll(None, "DEADLINE_EXCEEDED: Deadline Exceeded")
    assert not node.is_healthy and ended == []
    node.observe_poll(None, "DEADLINE_EXCEEDED: Deadline Exceeded")
    assert len(ended) == 1 and "DEADLINE_EXCEEDED" in ended[0]
    node.remove_leg(ended.append)
    assert node.num_in_flight == 0


def test_a_node_that_answers_not_serving_keeps_its_legs() -> None:
    """A draining node says NOT_SERVING and lets its requests finish: it is not hung."""
    node = Node("127.0.0.1:1", Role.DECODE)
    ended: list[str] = []
    node.add_leg(ended.append)
    for _ in range(3 * MAX_UNANSWERED_POLLS):
        node.observe_poll(NodeLoad(draining=True), "health: NOT_SERVING")
    node.mark_failed("a request saw it unreachable")
    assert not node.is_healthy and ended == []
    node.remove_leg(ended.append)


def test_under_recompute_a_hung_prefill_node_is_left_to_the_lease() -> None:
    """Under ``on_kv_failure=recompute`` the decode node computes the prompt itself once the
    reservation's lease runs out, where a retry might find no other prefill node: the prefill
    leg is not ended by the polls (here its call then finds nothing listening)."""

    async def cause(policy: str) -> str:
        # Nothing listens on port 1: each poll would find the node unreachable.
        pool = NodePool(("127.0.0.1:1",), ("127.0.0.1:2",), ())
        config = RouterConfig(("127.0.0.1:1",), ("127.0.0.1:2",), (), on_kv_failure=policy)
        legs = GrpcLegs(pool, config, GatewayMetrics())
        [prefill], [decode] = pool.prefill, pool.decode
        request = GenerationRequest("req", (1, 2, 3), SamplingParams(max_tokens=4))
        try:
            async with legs.prefill(prefill, "req.0", request, decode, 5.0) as leg:
                for _ in range(MAX_UNANSWERED_POLLS):
                    prefill.observe_poll(None, "UNAVAILABLE: connection refused")
                try:
                    await leg.reply(kv_pb2.KvReservation(transfer_id="t"))
                except RetryableFailure as failure:
                    return failure.cause
                raise AssertionError("a prefill node that is not there answered")
        finally:
            await pool.close()

    assert asyncio.run(cause(KvFailurePolicy.FAIL)) == "prefill_unresponsive"
    assert asyncio.run(cause(KvFailurePolicy.RECOMPUTE)) == "prefill_unavailable"


def test_the_503_says_when_no_prefill_node_is_left(tiny_llama_dir: Path) -> None:
    """The decode node refuses the first attempt (full); the waiting attempt then finds the only
    prefill node dead: the error names that, not the decode node's earlier refusal."""

    async def main() -> None:
        prefill_server, prefill = await serve_in_process(FakeNode(in_process_args("prefill")))
        decode_args = in_process_args("decode", refuse_unless_waiting=True)
        decode_server, decode = await serve_in_process(FakeNode(decode_args))
        try:
            async with gateway_on(tiny_llama_dir, [prefill], [decode]) as (gateway, stub):
                gateway.pool.interval_s = 600  # no poll finds it dead before the request does
                await asyncio.sleep(2 * HEALTH_INTERVAL_S)
                await prefill_server.stop(0)
                try:
                    await collect(stub, [31, 32, 33], max_tokens=4)
                except grpc.aio.AioRpcError as error:
                    assert error.code() == grpc.StatusCode.UNAVAILABLE
                    details = error.details()
                else:
                    raise AssertionError("served without a prefill node")
                assert details.startswith(
                    "no node could serve the request: no healthy prefill node"
                )
                assert details.index(prefill) < details.index(decode), "latest failure first"
        finally:
            await decode_server.stop(0)

    asyncio.run(main())
