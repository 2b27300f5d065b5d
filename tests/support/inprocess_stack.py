"""Nodes and a gateway in one process over real gRPC on localhost: the stack of the gateway's
integration tests (``tests/integration/test_gateway.py``, ``test_structured_outputs.py``).

``PDSERVE_TEST_TLS=1`` runs every stack with mutual TLS between the gateway and the nodes and
between prefill and decode.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import grpc

from decode_node.role import decode_services
from gateway.config import parse_gateway_config
from gateway.server import GatewayServer
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from prefill_node.role import prefill_services
from services.node.config import Role, parse_node_config
from services.node.runtime import start_node
from services.tls import TlsFiles, aio_channel
from support.node_argv import node_argv

MAX_MODEL_LEN = 256
GREEDY = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@functools.cache
def tls_dir() -> Path | None:
    """With PDSERVE_TEST_TLS=1: a deployment CA and one certificate for every process here."""
    if os.environ.get("PDSERVE_TEST_TLS") != "1":
        return None
    from deploy.certs import write_deployment

    directory = Path(tempfile.mkdtemp(prefix="pdserve-test-tls-"))
    atexit.register(shutil.rmtree, directory, True)
    write_deployment(directory, ["node", "gateway"])
    return directory


def tls_argv(name: str) -> list[str]:
    directory = tls_dir()
    if directory is None:
        return []
    return ["--tls-cert", str(directory / f"{name}.crt"), "--tls-key",
            str(directory / f"{name}.key"), "--tls-ca", str(directory / "ca.crt")]  # fmt: skip


def node_channel(address: str) -> grpc.aio.Channel:
    """A channel to a node, as the gateway opens it (mutual TLS with PDSERVE_TEST_TLS=1)."""
    directory = tls_dir()
    tls = None
    if directory is not None:
        tls = TlsFiles(directory / "gateway.crt", directory / "gateway.key", directory / "ca.crt")
    return aio_channel(address, tls)


def tls_node_flags(model_dir: Path, role: str, kv_memory: str) -> list[str]:
    flags = node_argv(model_dir, role, kv_memory=kv_memory, max_model_len=MAX_MODEL_LEN)
    return [*flags, *tls_argv("node")]


class Stack:
    """Nodes and a gateway in this process; ``nodes`` maps a name to (server, engine)."""

    def __init__(self, nodes: dict, gateway: GatewayServer) -> None:
        self.nodes = nodes
        self.gateway = gateway
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}")
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    async def generate(self, prompt: list[int], sampling=GREEDY, metadata=None, **fields):
        """(token ids, text, finished) of one request through the public API."""
        request = gateway_pb2.GatewayGenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling, **fields
        )
        tokens, text, finished = [], "", None
        async for event in self.stub.Generate(request, timeout=60, metadata=metadata):
            if event.WhichOneof("event") == "delta":
                tokens.extend(event.delta.token_ids)
                text += event.delta.text
            else:
                finished = event.finished
        return tokens, text, finished

    async def blocks_in_use(self) -> dict[str, int]:
        used = {}
        for name, (_, engine) in self.nodes.items():
            stats = await engine.call(lambda core: core.stats())
            used[name] = stats.num_blocks_used
        return used

    async def wait_all_free(self) -> None:
        for _ in range(500):
            if not any((await self.blocks_in_use()).values()):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"blocks still in use: {await self.blocks_in_use()}")

    async def close(self) -> None:
        await self.channel.close()
        await self.gateway.stop(grace_s=1)
        for server, engine in self.nodes.values():
            await server.drain()
            engine.shutdown()


def run_stack(
    model_dir: Path,
    body,
    decode_kv=("5MiB", "5MiB"),
    colocated=False,
    extra=(),
    prefill_extra=(),
    node_extra=(),
    decode_extra=(),
):
    """``extra``: the gateway's further flags; ``prefill_extra``: the prefill node's;
    ``decode_extra``: the decode nodes'; ``node_extra``: every node's."""

    async def main() -> None:
        nodes = {}
        if colocated:
            nodes["colocated"] = await start_node(
                parse_node_config(
                    [*tls_node_flags(model_dir, "colocated", "5MiB"), *node_extra], {}
                ),
                decode_services,
            )
        else:
            nodes["prefill"] = await start_node(
                parse_node_config(
                    [*tls_node_flags(model_dir, "prefill", "3MiB"), *prefill_extra, *node_extra],
                    {},
                    role=Role.PREFILL,
                ),
                prefill_services,
            )
            for i, memory in enumerate(decode_kv):
                nodes[f"decode{i}"] = await start_node(
                    parse_node_config(
                        [
                            *tls_node_flags(model_dir, "decode", memory),
                            *node_extra,
                            *decode_extra,
                        ],  # fmt: skip
                        {},
                        role=Role.DECODE,
                    ),
                    decode_services,
                )

        def addresses(prefix: str) -> str:
            return ",".join(
                f"127.0.0.1:{server.port}"
                for n, (server, _) in nodes.items()
                if n.startswith(prefix)
            )

        node_flags = (
            ["--colocated", addresses("colocated")]
            if colocated
            else ["--prefill", addresses("prefill"), "--decode", addresses("decode")]
        )
        config = parse_gateway_config(
            [
                "--model", str(model_dir), "--host", "127.0.0.1", "--http-port", "0",
                "--grpc-port", "0", "--max-model-len", str(MAX_MODEL_LEN),
                # No polls during a test: node failures are found by the requests themselves.
                "--health-interval-s", "60", *node_flags, *extra, *tls_argv("gateway"),
            ],
            {},
        )  # fmt: skip
        gateway = GatewayServer(config)
        await gateway.start()
        stack = Stack(nodes, gateway)
        try:
            await body(stack)
        finally:
            await stack.close()

    asyncio.run(main())
