"""Node discovery: ``dns:///name:port`` node lists, re-resolved before every health poll, against
fake nodes (tests/support/fake_node.py) and a resolver whose answers the test changes while
requests are in flight."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from gateway.config import RouterConfig, parse_gateway_config
from gateway.routing.node import NodeHealth
from gateway.routing.node_discovery import DnsResolver, ResolveError, parse_target
from gateway.routing.node_pool import NodePool
from gateway.routing.router import Router
from gateway.server import GatewayServer
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

WAIT_S = 30  # generous: a loaded host polls late, never wrongly


class ScriptedResolver:
    """Answers from a dict the test edits; a name mapped to an exception raises it."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str] | Exception] = {}
        self.calls = 0

    async def resolve(self, host: str, port: int) -> list[str]:
        self.calls += 1
        answer = self.answers[host]
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


async def start_fake(fake_node, role: str, **script):
    class Counting(fake_node.FakeNode):
        generated = 0

        async def Generate(self, request, context):
            self.generated += 1
            async for response in super().Generate(request, context):
                yield response

    node = Counting(fake_node.in_process_args(role, **script))
    server, address = await fake_node.serve_in_process(node)
    return server, node, address


async def wait_for(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for: {what}"
        await asyncio.sleep(0.02)


def addresses(nodes) -> set[str]:
    return {node.address for node in nodes}


# --- parsing ---------------------------------------------------------------------------------


def test_targets_parse_as_fixed_addresses_or_dns_names() -> None:
    fixed = parse_target("10.0.0.1:50061")
    assert (fixed.host, fixed.port, fixed.dns) == ("10.0.0.1", 50061, False)
    dns = parse_target("dns:///prefill.pdserve.svc.cluster.local:50061")
    assert (dns.host, dns.port, dns.dns) == ("prefill.pdserve.svc.cluster.local", 50061, True)
    assert str(dns) == "dns:///prefill.pdserve.svc.cluster.local:50061"
    assert parse_target("[::1]:7").host == "[::1]"
    for bad in ("dns:///no-port", "dns://8.8.8.8/name:1", "name:99999", "http://a:1"):
        with pytest.raises(ValueError, match="host:port or dns:///name:port"):
            parse_target(bad)


def test_the_gateway_flags_accept_dns_names(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 128}')
    config = parse_gateway_config(
        ["--model", str(tmp_path), "--prefill", "dns:///p.ns.svc:50061,10.0.0.9:50061",
         "--decode", "dns:///d.ns.svc:50071"],
        {},
    )  # fmt: skip
    assert config.router.prefill == ("dns:///p.ns.svc:50061", "10.0.0.9:50061")
    with pytest.raises(ValueError, match="not host:port or dns:///name:port"):
        RouterConfig(prefill=("dns:///",), decode=("d:1",), colocated=())


# --- the system resolver ---------------------------------------------------------------------


def test_the_dns_resolver_answers_every_address_with_the_port() -> None:
    answer = asyncio.run(DnsResolver().resolve("localhost", 4321))
    assert "127.0.0.1:4321" in answer or "[::1]:4321" in answer
    assert answer == sorted(set(answer))


@pytest.mark.parametrize(
    ("errno", "outcome"), [(socket.EAI_NONAME, "empty"), (socket.EAI_AGAIN, "error")]
)
def test_no_such_name_means_no_nodes_but_a_failed_lookup_is_an_error(
    monkeypatch, errno, outcome
) -> None:
    async def failing(*args, **kwargs):
        raise socket.gaierror(errno, "scripted")

    async def resolve():
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", failing)
        return await DnsResolver().resolve("gone.example", 1)

    if outcome == "empty":
        assert asyncio.run(resolve()) == []
    else:
        with pytest.raises(ResolveError, match="gone.example"):
            asyncio.run(resolve())


# --- the pool --------------------------------------------------------------------------------


def test_new_nodes_join_after_a_health_check_and_failed_lookups_change_nothing(
    fake_node,
) -> None:
    async def main() -> None:
        servers = [await start_fake(fake_node, "decode") for _ in range(2)]
        (_, _, d1), (_, _, d2) = servers
        resolver = ScriptedResolver()
        resolver.answers["decode.test"] = [d1]
        pool = NodePool((), ("dns:///decode.test:1", "127.0.0.1:1"), (), resolver=resolver)
        # No prefill node: short prompts are served by the decode node alone.
        local = RouterConfig(prefill=("p:1",), decode=("d:1",), colocated=(),
                             local_prefill_max_tokens=8)  # fmt: skip
        router = Router(pool, local)
        try:
            assert addresses(pool.decode) == {"127.0.0.1:1"}  # fixed entries from the start
            await pool.refresh()
            assert addresses(pool.decode) == {"127.0.0.1:1", d1}
            joined = next(n for n in pool.decode if n.address == d1)
            assert joined.health is NodeHealth.UNKNOWN and router.pick([1]) is None
            await pool.poll_once()
            assert joined.is_healthy and router.pick([1]).decode is joined
            # The fixed entry points at nothing: polled unhealthy, never dropped.
            assert addresses(n for n in pool.decode if not n.is_healthy) == {"127.0.0.1:1"}

            for failure in (ResolveError("dns down"), OSError("resolver socket")):
                resolver.answers["decode.test"] = failure
                await pool.poll_once()
                assert addresses(pool.decode) == {"127.0.0.1:1", d1} and not pool.retiring

            resolver.answers["decode.test"] = [d1, d2]
            await pool.refresh()
            assert addresses(pool.decode) == {"127.0.0.1:1", d1, d2}
            assert router.pick([1]).decode is joined  # d2 waits for its health check
            await pool.poll_once()
            assert {n.address for n in pool.decode if n.is_healthy} == {d1, d2}

            resolver.answers["decode.test"] = []  # no ready pod behind the name
            await pool.poll_once()
            assert addresses(pool.decode) == {"127.0.0.1:1"} and not pool.retiring
            assert not pool.is_ready()
        finally:
            await pool.close()
            for server, _, _ in servers:
                await server.stop(0)

    asyncio.run(main())


def test_a_node_that_leaves_discovery_finishes_its_stream_then_retires(
    fake_node, tiny_llama_dir
) -> None:
    """decode d1 streams slowly; mid-stream DNS stops naming it and names d2 instead. The stream
    completes on d1, new requests go to d2, and d1's channel closes once it is idle."""

    async def main() -> None:
        prefill_server, _, p1 = await start_fake(fake_node, "prefill")
        d1_server, d1, d1_address = await start_fake(fake_node, "decode", itl_ms=20)
        d2_server, d2, d2_address = await start_fake(fake_node, "decode")
        resolver = ScriptedResolver()
        resolver.answers = {"prefill.test": [p1], "decode.test": [d1_address]}
        config = parse_gateway_config(
            ["--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--http-port", "0",
             "--grpc-port", "0", "--max-model-len", "512", "--health-interval-s", "0.05",
             "--prefill", "dns:///prefill.test:50061", "--decode", "dns:///decode.test:50071"],
            {},
        )  # fmt: skip
        gateway = GatewayServer(config)
        gateway.pool.resolver = resolver
        await gateway.start()
        pool = gateway.pool
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                request = gateway_pb2.GatewayGenerateRequest(
                    token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]),
                    sampling=common_pb2.SamplingParams(max_tokens=60),
                )
                stream = stub.Generate(request, timeout=60)
                tokens: list[int] = []
                finished = None
                switched = False
                async for event in stream:
                    if event.WhichOneof("event") == "delta":
                        tokens.extend(event.delta.token_ids)
                    else:
                        finished = event.finished
                    if len(tokens) == 5 and not switched:
                        switched = True
                        # In flight on d1: DNS now names d2 only.
                        resolver.answers["decode.test"] = [d2_address]
                        calls = resolver.calls
                        await wait_for(lambda c=calls: resolver.calls > c + 2, "two refreshes")
                        assert addresses(pool.decode) == {d2_address}
                        assert addresses(pool.retiring) == {d1_address}
                        await wait_for(lambda: pool.decode[0].is_healthy, "d2 healthy")
                        short = gateway_pb2.GatewayGenerateRequest(
                            token_ids=gateway_pb2.TokenIds(ids=[9, 9]),
                            sampling=common_pb2.SamplingParams(max_tokens=3),
                        )
                        other = [e async for e in stub.Generate(short, timeout=30)]
                        assert other[-1].finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
                        assert (d1.generated, d2.generated) == (1, 1)
                        assert d1.running == 1  # the first stream is still on d1
                assert switched and d1.generated == 1
                assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert len(tokens) == 60 and finished.num_retries == 0
                await wait_for(lambda: not pool.retiring, "d1 retired")
                assert addresses(pool.decode) == {d2_address}
        finally:
            await gateway.stop(grace_s=0.5)
            for server in (prefill_server, d1_server, d2_server):
                await server.stop(0)

    asyncio.run(main())


def test_an_address_that_returns_before_retiring_is_the_same_node(fake_node) -> None:
    async def main() -> None:
        server, _, d1 = await start_fake(fake_node, "decode")
        resolver = ScriptedResolver()
        resolver.answers["decode.test"] = [d1]
        pool = NodePool((), ("dns:///decode.test:1",), (), resolver=resolver)
        try:
            await pool.poll_once()
            (node,) = pool.decode
            node.num_in_flight = 1  # a request is on it
            resolver.answers["decode.test"] = []
            await pool.poll_once()
            assert pool.decode == [] and pool.retiring == [node]
            resolver.answers["decode.test"] = [d1]
            await pool.poll_once()
            assert pool.decode == [node] and pool.retiring == [] and node.is_healthy
            node.num_in_flight = 0
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(main())


def test_a_discovered_node_checks_its_certificate_against_the_service_name(fake_node) -> None:
    # Under mutual TLS a node found through DNS is dialled at its pod IP, which no certificate
    # names: its certificate is checked against the name it was discovered under.
    async def main() -> None:
        server, _, d1 = await start_fake(fake_node, "decode")
        resolver = ScriptedResolver()
        resolver.answers["decode.test"] = [d1]
        pool = NodePool(("127.0.0.1:9",), ("dns:///decode.test:1",), (), resolver=resolver)
        try:
            await pool.poll_once()
            assert [n.tls_name for n in pool.decode] == ["decode.test"]
            assert [n.tls_name for n in pool.prefill] == [None]
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(main())
