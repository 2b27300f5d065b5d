"""Mutual TLS between the services, and TLS at the gateway's edge, over real gRPC on localhost.

Certificates come from ``deploy.certs`` (a deployment CA, and a second, foreign CA). Every node
port (prefill, decode, colocated) refuses a plaintext client, a TLS client without a
certificate and a client whose certificate another CA signed; a client with a deployment
certificate gets health and load. Through a gateway with TLS on every hop (client → gateway over
TLS, gateway → nodes and prefill → decode over mutual TLS), greedy tokens equal the single
engine's, over gRPC and over HTTPS; a key over its rate gets RESOURCE_EXHAUSTED while others do
not, and no key reaches the logs.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_node.role import decode_services
from deploy.certs import write_deployment
from deploy.health import GrpcHealth
from deploy.probe import main as probe_main
from gateway.config import parse_gateway_config
from gateway.server import GatewayServer
from pdserve.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2_grpc
from prefill_node.role import prefill_services
from services.engine import LLM, SamplingParams
from services.node.config import Role, parse_node_config
from services.node.runtime import start_node
from services.tls import TlsFiles, aio_channel
from support.node_argv import node_argv

MAX_MODEL_LEN = 256
GREEDY = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SERVICES = ["prefill-0", "decode-0", "colocated-0", "gateway", "client"]
SECRET_A = "sk-tls-alpha-5d1e9b"
SECRET_B = "sk-tls-bravo-c27f04"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the deployment's directory, a foreign CA's directory with its own 'client')."""
    deployment = tmp_path_factory.mktemp("certs")
    foreign = tmp_path_factory.mktemp("foreign")
    write_deployment(deployment, SERVICES)
    write_deployment(foreign, ["client"])
    return deployment, foreign


def files(directory: Path, name: str, ca_dir: Path | None = None) -> TlsFiles:
    ca = (ca_dir or directory) / "ca.crt"
    return TlsFiles(directory / f"{name}.crt", directory / f"{name}.key", ca)


def tls_flags(directory: Path, name: str) -> list[str]:
    return [
        "--tls-cert", str(directory / f"{name}.crt"), "--tls-key", str(directory / f"{name}.key"),
        "--tls-ca", str(directory / "ca.crt"),
    ]  # fmt: skip


def flags_for(model_dir: Path, role: str, kv_memory: str) -> list[str]:
    return node_argv(model_dir, role, kv_memory=kv_memory, max_model_len=MAX_MODEL_LEN)


async def start_nodes(model_dir: Path, certs_dir: Path) -> dict:
    nodes = {}
    nodes["prefill"] = await start_node(
        parse_node_config(
            [*flags_for(model_dir, "prefill", "3MiB"), *tls_flags(certs_dir, "prefill-0")],
            {},
            role=Role.PREFILL,
        ),
        prefill_services,
    )
    # The decode node takes its TLS files from the PDSERVE_TLS_* fallbacks, as a Kubernetes
    # Secret mounted as environment variables gives them.
    environ = {
        "PDSERVE_TLS_CERT": str(certs_dir / "decode-0.crt"),
        "PDSERVE_TLS_KEY": str(certs_dir / "decode-0.key"),
        "PDSERVE_TLS_CA": str(certs_dir / "ca.crt"),
    }
    nodes["decode"] = await start_node(
        parse_node_config(flags_for(model_dir, "decode", "5MiB"), environ, role=Role.DECODE),
        decode_services,
    )
    nodes["colocated"] = await start_node(
        parse_node_config(
            [*flags_for(model_dir, "colocated", "5MiB"), *tls_flags(certs_dir, "colocated-0")], {}
        ),
        decode_services,
    )
    return nodes


async def stop_nodes(nodes: dict) -> None:
    for server, engine in nodes.values():
        await server.drain()
        engine.shutdown()


async def health_status(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status


async def refused(channel: grpc.aio.Channel) -> grpc.StatusCode:
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await health_status(channel)
    return error.value.code()


def test_every_node_port_requires_a_certificate_from_the_deployment_ca(
    tiny_llama_dir: Path, certs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment, foreign = certs

    async def main() -> None:
        nodes = await start_nodes(tiny_llama_dir, deployment)
        try:
            for name, (server, _) in nodes.items():
                address = f"127.0.0.1:{server.port}"
                # Plaintext: the server speaks only TLS.
                assert await refused(grpc.aio.insecure_channel(address)) is (
                    grpc.StatusCode.UNAVAILABLE
                ), name
                # TLS that trusts the CA but presents no certificate.
                no_cert = grpc.ssl_channel_credentials((deployment / "ca.crt").read_bytes())
                assert await refused(grpc.aio.secure_channel(address, no_cert)) is (
                    grpc.StatusCode.UNAVAILABLE
                ), name
                # A certificate from another CA (the client itself trusts the deployment's CA,
                # so it is the server that refuses).
                stranger = files(foreign, "client", ca_dir=deployment)
                assert await refused(aio_channel(address, stranger)) is (
                    grpc.StatusCode.UNAVAILABLE
                ), name
                # A client that trusts only the foreign CA refuses the node's certificate too.
                assert await refused(aio_channel(address, files(foreign, "client"))) is (
                    grpc.StatusCode.UNAVAILABLE
                ), name
                # The deployment's certificate: health and load answer.
                async with aio_channel(address, files(deployment, "client")) as channel:
                    assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
                    stub = (
                        prefill_pb2_grpc.PrefillServiceStub(channel)
                        if name == "prefill"
                        else decode_pb2_grpc.DecodeServiceStub(channel)
                    )
                    report = await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)
                    assert report.role == name
                # The launcher's and compose's probe, with and without the certificate.
                probe = GrpcHealth(address, tls=files(deployment, "client"))
                assert await asyncio.to_thread(probe.check, 10.0)
                assert not await asyncio.to_thread(GrpcHealth(address).check, 10.0)
                # python -m deploy.probe (compose healthchecks) reads PDSERVE_TLS_* as a node does.
                assert await asyncio.to_thread(probe_main, ["grpc", address]) == 1
                with monkeypatch.context() as patch:
                    for part, suffix in (("CERT", "crt"), ("KEY", "key")):
                        patch.setenv(f"PDSERVE_TLS_{part}", str(deployment / f"client.{suffix}"))
                    patch.setenv("PDSERVE_TLS_CA", str(deployment / "ca.crt"))
                    assert await asyncio.to_thread(probe_main, ["grpc", address]) == 0
        finally:
            await stop_nodes(nodes)

    asyncio.run(main())


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path):
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in (5, 40, 120)]
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return prompts, [list(o.token_ids) for o in offline.generate(prompts, params)]


async def generate(stub, prompt: list[int], secret: str) -> list[int]:
    request = gateway_pb2.GatewayGenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=GREEDY
    )
    tokens = []
    metadata = (("authorization", f"Bearer {secret}"),)
    async for event in stub.Generate(request, timeout=60, metadata=metadata):
        if event.WhichOneof("event") == "delta":
            tokens.extend(event.delta.token_ids)
    return tokens


def test_greedy_tokens_through_a_gateway_with_tls_on_every_hop(
    tiny_llama_dir: Path,
    certs: tuple[Path, Path],
    expected,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import httpx
    import openai

    caplog.set_level(logging.DEBUG)
    deployment, _ = certs
    prompts, tokens = expected
    key_file = tmp_path / "keys.yaml"
    key_file.write_text(
        f"keys:\n"
        f"  - {{name: team-a, key: {SECRET_A}, requests_per_minute: 100}}\n"
        f"  - {{name: team-b, key: {SECRET_B}, requests_per_minute: 1}}\n"
    )

    async def main() -> None:
        nodes = await start_nodes(tiny_llama_dir, deployment)
        gateways = []
        try:
            for node_flags in (
                ["--prefill", f"127.0.0.1:{nodes['prefill'][0].port}",
                 "--decode", f"127.0.0.1:{nodes['decode'][0].port}"],
                ["--colocated", f"127.0.0.1:{nodes['colocated'][0].port}"],
            ):  # fmt: skip
                config = parse_gateway_config(
                    [
                        "--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--http-port", "0",
                        "--grpc-port", "0", "--max-model-len", str(MAX_MODEL_LEN),
                        "--health-interval-s", "60", "--api-key-file", str(key_file),
                        "--public-tls-cert", str(deployment / "gateway.crt"),
                        "--public-tls-key", str(deployment / "gateway.key"),
                        *tls_flags(deployment, "gateway"), *node_flags,
                    ],
                    {},
                )  # fmt: skip
                gateway = GatewayServer(config)
                await gateway.start()
                gateways.append(gateway)
                # The start-up poll reached the nodes over mutual TLS.
                assert gateway.pool.is_ready()

                # gRPC over TLS (server authentication only: clients bring API keys).
                credentials = grpc.ssl_channel_credentials((deployment / "ca.crt").read_bytes())
                address = f"127.0.0.1:{gateway.grpc_port}"
                async with grpc.aio.secure_channel(address, credentials) as channel:
                    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                    results = await asyncio.gather(*(generate(stub, p, SECRET_A) for p in prompts))
                    assert results == tokens
                # The public gRPC port refuses plaintext.
                async with grpc.aio.insecure_channel(address) as plain:
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await generate(gateway_pb2_grpc.GatewayServiceStub(plain), [1, 2], SECRET_A)
                    assert error.value.code() == grpc.StatusCode.UNAVAILABLE

                # HTTPS with the official client.
                http = httpx.AsyncClient(
                    verify=ssl.create_default_context(cafile=str(deployment / "ca.crt"))
                )
                client = openai.AsyncOpenAI(
                    base_url=f"https://127.0.0.1:{gateway.http_port}/v1",
                    api_key=SECRET_A,
                    max_retries=0,
                    http_client=http,
                )
                completion = await client.completions.create(
                    model=gateway.frontend.served_model_name,
                    prompt=prompts[1],
                    max_tokens=8,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                tokenizer = gateway.frontend.tokenizer
                assert completion.choices[0].text == tokenizer.decode(tokens[1])
                await client.close()

            # team-b may start one request a minute; the gateways count separately, so its
            # second request on the second gateway is the refused one.
            gateway = gateways[1]
            credentials = grpc.ssl_channel_credentials((deployment / "ca.crt").read_bytes())
            address = f"127.0.0.1:{gateway.grpc_port}"
            async with grpc.aio.secure_channel(address, credentials) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                assert await generate(stub, prompts[0], SECRET_B) == tokens[0]
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await generate(stub, prompts[0], SECRET_B)
                assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "team-b" in error.value.details()
                trailers = dict(error.value.trailing_metadata() or ())
                assert int(trailers["retry-after"]) >= 1
                assert await generate(stub, prompts[0], SECRET_A) == tokens[0]
        finally:
            for gateway in gateways:
                await gateway.stop(grace_s=1)
            await stop_nodes(nodes)

    asyncio.run(main())
    assert SECRET_A not in caplog.text and SECRET_B not in caplog.text
