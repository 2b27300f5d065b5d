"""What mutual TLS between the services costs: the same prefill + decode + gateway stack run
twice in one process, once in plaintext and once with mTLS on every internal hop (gateway to
nodes, prefill to decode), measured in interleaved rounds so both see the same machine load.

Per round and stack: ``--num-unary`` sequential GetLoad round trips straight to the decode
node (the cost of one small RPC), then ``--num-requests`` generations sent at once through the
gateway's gRPC API (TTFT and wall time; the tiny random-weight model, loopback KV transport).

    .venv/bin/python -P benchmarks/tls_overhead.py --rounds 3   # -P: benchmarks/kv_transfer.py
    # would shadow the kv_transfer package
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from decode_node.role import decode_services
from deploy.certs import write_deployment
from gateway.config import parse_gateway_config
from gateway.server import GatewayServer
from pdserve.v1 import common_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from prefill_node.role import prefill_services
from services.models.tiny import build_tiny_model
from services.node.config import Role, parse_node_config
from services.node.runtime import start_node
from services.tls import TlsFiles, aio_channel


def tls_argv(certs: Path | None, name: str) -> list[str]:
    if certs is None:
        return []
    return ["--tls-cert", str(certs / f"{name}.crt"), "--tls-key", str(certs / f"{name}.key"),
            "--tls-ca", str(certs / "ca.crt")]  # fmt: skip


class Stack:
    def __init__(self, label: str, model: Path, certs: Path | None) -> None:
        self.label, self.model, self.certs = label, model, certs
        self.client_tls = (
            None
            if certs is None
            else TlsFiles(certs / "gateway.crt", certs / "gateway.key", certs / "ca.crt")
        )

    async def start(self) -> None:
        def node(role: str, memory: str) -> list[str]:
            return [
                "--role", role, "--model", str(self.model), "--dtype", "float32",
                "--host", "127.0.0.1", "--grpc-port", "0", "--kv-transport", "loopback",
                "--max-model-len", "512", "--kv-cache-memory", memory, "--drain-grace-s", "1",
                *tls_argv(self.certs, f"{role}-0"),
            ]  # fmt: skip

        self.prefill = await start_node(
            parse_node_config(node("prefill", "16MiB"), {}, role=Role.PREFILL), prefill_services
        )
        self.decode = await start_node(
            parse_node_config(node("decode", "32MiB"), {}, role=Role.DECODE), decode_services
        )
        self.decode_address = f"127.0.0.1:{self.decode[0].port}"
        config = parse_gateway_config(
            [
                "--model", str(self.model), "--host", "127.0.0.1", "--http-port", "0",
                "--grpc-port", "0", "--max-model-len", "512",
                "--prefill", f"127.0.0.1:{self.prefill[0].port}",
                "--decode", self.decode_address, *tls_argv(self.certs, "gateway"),
            ],
            {},
        )  # fmt: skip
        self.gateway = GatewayServer(config)
        await self.gateway.start()

    async def unary_us(self, n: int) -> float:
        async with aio_channel(self.decode_address, self.client_tls) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=30)  # handshake outside
            started = time.perf_counter()
            for _ in range(n):
                await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=30)
            return (time.perf_counter() - started) / n * 1e6

    async def burst(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        """(median TTFT s, wall s) of the prompts sent at once."""
        async with aio_channel(f"127.0.0.1:{self.gateway.grpc_port}", None) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            sampling = common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            )

            async def one(prompt: list[int]) -> float:
                started = time.perf_counter()
                ttft = None
                request = gateway_pb2.GatewayGenerateRequest(
                    token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling
                )
                async for event in stub.Generate(request, timeout=600):
                    if ttft is None and event.WhichOneof("event") == "delta":
                        ttft = time.perf_counter() - started
                assert ttft is not None
                return ttft

            started = time.perf_counter()
            ttfts = await asyncio.gather(*(one(p) for p in prompts))
            return statistics.median(ttfts), time.perf_counter() - started

    async def stop(self) -> None:
        await self.gateway.stop(grace_s=1)
        for server, engine in (self.prefill, self.decode):
            await server.drain()
            engine.shutdown()


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="pdserve-tls-bench-"))
    model = build_tiny_model(work / "model", arch="llama", size="tiny")
    write_deployment(work / "certs", ["prefill-0", "decode-0", "gateway"])
    stacks = [Stack("plaintext", model, None), Stack("mTLS", model, work / "certs")]
    for stack in stacks:
        await stack.start()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(5, 4000) for _ in range(args.input_len)] for _ in range(args.num_requests)
    ]
    rows = []
    try:
        for round_ in range(args.rounds):
            order = stacks if round_ % 2 == 0 else stacks[::-1]
            for stack in order:
                unary = await stack.unary_us(args.num_unary)
                ttft, wall = await stack.burst(prompts, args.output_len)
                rows.append((round_ + 1, stack.label, unary, ttft, wall))
    finally:
        for stack in stacks:
            await stack.stop()
    print("| round | stack | GetLoad round trip | median TTFT | burst wall time |")
    print("|---|---|---|---|---|")
    for round_, label, unary, ttft, wall in rows:
        print(f"| {round_} | {label} | {unary:.0f} us | {ttft * 1e3:.0f} ms | {wall:.2f} s |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-unary", type=int, default=500)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    asyncio.run(main(parser.parse_args()))
