"""A fake pdserve node with no model: it speaks the node protocol (PrefillService,
DecodeService, grpc.health.v1) and answers instantly or with scripted delays and failures.

Two uses:
- measuring the gateway's own overhead per streamed token (issue 6: nodes replaced by a fast
  fake, so every microsecond measured is the gateway's);
- driving the gateway into failures a real node only shows under faults: a refusal, a stream
  that breaks after some tokens.

Tokens are ``(prompt[-1] + i) % vocab`` so a client can check what it got. The decode role keeps
the node contract: the first event is a reservation, tokens 2..N follow the prefill's commit.

    python tests/support/fake_node.py --role colocated --port 50081 [--itl-ms 0] [--ttft-ms 0]
        [--fail-after-tokens K] [--refuse | --refuse-unless-waiting]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root

from pdserve.v1 import (  # noqa: E402  (after the path set-up, when run as a script)
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)

logger = logging.getLogger("fake_node")
VOCAB = 1000


class FakeNode(prefill_pb2_grpc.PrefillServiceServicer, decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.commits: dict[str, asyncio.Future[kv_pb2.KvCommit]] = {}
        self.running = 0
        self.prompts: list[list[int]] = []
        """Every Generate call's prompt, in arrival order (what the gateway made of a request)."""
        self.samplings: list[common_pb2.SamplingParams] = []
        """Every Generate call's sampling parameters, in the same order."""
        self.script: list[int] | None = getattr(args, "script", None)
        """Token ids to answer every request with (then stop) instead of the counting ones."""

    def _limit(self, max_tokens: int) -> int:
        return max_tokens if self.script is None else min(max_tokens, len(self.script))

    def _token(self, prompt: list[int], i: int) -> int:
        if self.script is not None:
            return self.script[i]
        return (prompt[-1] + i) % VOCAB if prompt else i % VOCAB

    async def Prefill(self, request, context):
        await asyncio.sleep(self.args.ttft_ms / 1000)
        first = self._token(list(request.prompt_token_ids), 0)
        if request.HasField("destination"):
            async with grpc.aio.insecure_channel(request.decode_target) as channel:
                await decode_pb2_grpc.DecodeServiceStub(channel).CommitKv(
                    kv_pb2.KvCommit(
                        transfer_id=request.destination.transfer_id, first_token_id=first
                    ),
                    timeout=10,
                )
        return prefill_pb2.PrefillResult(first_token_id=first)

    async def CommitKv(self, request, context):
        future = self.commits.get(request.transfer_id)
        if future is None or future.done():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "unknown transfer_id")
        future.set_result(request)
        return kv_pb2.KvCommitAck()

    async def Generate(self, request, context):
        if self.args.refuse:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake node: full (--refuse)")
        if getattr(self.args, "refuse_unless_waiting", False) and not request.wait_for_room:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "fake node: full unless the caller waits"
            )
        prompt = list(request.prompt_token_ids)
        self.prompts.append(prompt)
        self.samplings.append(request.sampling)
        requested = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        max_tokens = self._limit(requested)
        # A script ends in a stop (its last token is the model's EOS) unless max_tokens cuts it
        # short first, as a real node would say.
        reason = (
            common_pb2.FINISH_REASON_STOP
            if self.script is not None and len(self.script) < requested
            else common_pb2.FINISH_REASON_LENGTH
        )
        self.running += 1
        try:
            start = 0
            if request.kv_source:
                transfer_id = uuid.uuid4().hex
                self.commits[transfer_id] = asyncio.get_running_loop().create_future()
                yield decode_pb2.GenerateResponse(
                    reservation=kv_pb2.KvReservation(
                        transfer_id=transfer_id,
                        address=kv_pb2.KvAddress(transport="fake"),
                        block_ids=list(range((len(prompt) + 15) // 16)),
                        block_size=16,
                    )
                )
                try:
                    await asyncio.wait_for(self.commits[transfer_id], 30)
                finally:
                    del self.commits[transfer_id]
                start = 1  # the first token came from the prefill node
            else:
                await asyncio.sleep(self.args.ttft_ms / 1000)
            for i in range(start, max_tokens):
                if self.args.fail_after_tokens is not None and i >= self.args.fail_after_tokens:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake node: failed")
                if i > start and self.args.itl_ms:
                    await asyncio.sleep(self.args.itl_ms / 1000)
                yield decode_pb2.GenerateResponse(
                    tokens=decode_pb2.TokenDelta(token_ids=[self._token(prompt, i)])
                )
            yield decode_pb2.GenerateResponse(
                finished=decode_pb2.Finished(
                    finish_reason=reason,
                    usage=common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=max_tokens),
                )
            )
        finally:
            self.running -= 1

    async def Abort(self, request, context):
        return decode_pb2.AbortResponse(found=False)

    async def GetLoad(self, request, context):
        return common_pb2.LoadReport(
            node_id=f"fake:{self.args.port}",
            role=self.args.role,
            num_running=self.running,
            kv_blocks_total=1000,
        )


def in_process_args(role: str, **script: object) -> argparse.Namespace:
    """The flags of a fake node a test drives in its own event loop; ``script`` overrides them
    (``ttft_ms``, ``fail_after_tokens``, ``script``...)."""
    args = argparse.Namespace(
        role=role, port=0, ttft_ms=0.0, itl_ms=0.0, fail_after_tokens=None, refuse=False
    )
    vars(args).update(script)
    return args


async def serve_in_process(node: FakeNode) -> tuple[grpc.aio.Server, str]:
    """``node`` served on a free loopback port in the running event loop: the server (the test
    stops it) and its address."""
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(node, server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(node, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def serve(args: argparse.Namespace) -> None:
    server = grpc.aio.server()
    node = FakeNode(args)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(node, server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(node, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"fake {args.role} node on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["prefill", "decode", "colocated"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--fail-after-tokens", type=int, default=None)
    parser.add_argument("--refuse", action="store_true", help="refuse every Generate (full)")
    parser.add_argument(
        "--refuse-unless-waiting",
        action="store_true",
        help="refuse a Generate unless it asks to wait for room (room frees while it waits)",
    )
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
