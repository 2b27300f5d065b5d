"""A colocated decode node over real gRPC on localhost, with the tiny model.

Most tests run the node in this process (fast); one starts ``python -m decode_node`` as a real
process and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_node.role import decode_services
from deploy.local_ports import free_ports
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.engine import LLM, SamplingParams
from services.node.config import Role, parse_node_config
from services.node.runtime import start_node
from support.huge_page_heap import heap_is_huge_page_advised, host_takes_huge_page_heap
from support.node_argv import node_argv
from support.startup_channel import startup_channel

MAX_MODEL_LEN = 128
GREEDY = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
GREEDY_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def colocated_argv(model_dir: Path) -> list[str]:
    return node_argv(
        model_dir, "colocated", kv_memory="2MiB", max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=None, drain_grace_s=2,
    )  # fmt: skip


def run_with_node(model_dir: Path, body, *, with_engine: bool = False) -> None:
    """Start a node in this process, run ``await body(stub)`` (``body(stub, engine)`` with
    ``with_engine``), then drain it."""

    async def main() -> None:
        config = parse_node_config(colocated_argv(model_dir), {}, role=Role.DECODE)
        server, engine = await start_node(config, decode_services)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            await (body(stub, engine) if with_engine else body(stub))
        finally:
            await channel.close()
            await server.drain()
            engine.shutdown()

    asyncio.run(main())


async def generate(stub, prompt: list[int], sampling=GREEDY, request_id: str = ""):
    tokens, finished = [], None
    request = decode_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling
    )
    async for event in stub.Generate(request, timeout=30):
        if event.WhichOneof("event") == "tokens":
            tokens.extend(event.tokens.token_ids)
        else:
            finished = event.finished
    return tokens, finished


async def load(stub) -> common_pb2.LoadReport:
    return await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)


async def wait_idle(stub) -> common_pb2.LoadReport:
    for _ in range(200):
        report = await load(stub)
        if report.kv_blocks_used == 0 and report.num_running == 0 and report.num_waiting == 0:
            return report
        await asyncio.sleep(0.01)
    raise AssertionError(f"node never went idle: {report}")


def test_concurrent_streams_equal_the_engine(tiny_llama_dir: Path) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 4096) for _ in range(n)] for n in (1, 9, 30, 64, 17)]
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(prompts, params)]

    async def body(stub) -> None:
        results = await asyncio.gather(*(generate(stub, p) for p in prompts))
        assert [tokens for tokens, _ in results] == expected
        for prompt, (_, finished) in zip(prompts, results, strict=True):
            assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert finished.usage.prompt_tokens == len(prompt)
            assert finished.usage.completion_tokens == 8
            timings = finished.timings  # the prompt never left this node: no transfer, no queue
            assert timings.prefill_queue_s >= 0 and timings.prefill_compute_s > 0
            assert timings.kv_transfer_s == 0 and timings.decode_queue_s == 0
            assert 0 < timings.first_decode_step_s <= timings.decode_s
        report = await wait_idle(stub)
        assert report.role == "colocated" and report.kv_blocks_total > 0
        assert len(report.kv_layout_fingerprint) == 16

    run_with_node(tiny_llama_dir, body)


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], GREEDY, "prompt_token_ids is empty"),
        ([1, 5000], GREEDY, r"prompt_token_ids\[1\] = 5000 is outside the vocabulary"),
        ([1] * (MAX_MODEL_LEN + 1), GREEDY, "max_model_len is 128"),
        ([1, 2], common_pb2.SamplingParams(max_tokens=0), "sampling.max_tokens must be >= 1"),
        ([1, 2], common_pb2.SamplingParams(top_p=1.5), r"sampling.top_p must be in \(0, 1\]"),
        ([1, 2], common_pb2.SamplingParams(temperature=-1), "sampling.temperature must be >= 0"),
    ],
)
def test_bad_requests_are_invalid_argument(tiny_llama_dir, prompt, sampling, message) -> None:
    async def body(stub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub, prompt, sampling)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(message, error.value.details())
        await wait_idle(stub)
        tokens, _ = await generate(stub, [1, 2, 3])  # the node still serves
        assert len(tokens) == 8

    run_with_node(tiny_llama_dir, body)


def test_a_cancelled_stream_frees_its_blocks_and_abort_ends_a_stream(tiny_llama_dir) -> None:
    long = common_pb2.SamplingParams(max_tokens=100, ignore_eos=True)

    async def body(stub) -> None:
        request = decode_pb2.GenerateRequest(prompt_token_ids=list(range(10, 60)), sampling=long)
        call = stub.Generate(request, timeout=30)
        await call.read()
        await call.read()
        call.cancel()
        await wait_idle(stub)

        aborted = decode_pb2.GenerateRequest(
            request_id="abort-me", prompt_token_ids=list(range(10, 60)), sampling=long
        )
        call = stub.Generate(aborted, timeout=30)
        await call.read()
        assert (await stub.Abort(decode_pb2.AbortRequest(request_id="abort-me"))).found
        events = []
        while (event := await call.read()) is not grpc.aio.EOF:
            events.append(event)
        assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_ABORT
        await wait_idle(stub)
        assert not (await stub.Abort(decode_pb2.AbortRequest(request_id="abort-me"))).found

    run_with_node(tiny_llama_dir, body)


def test_get_load_answers_while_the_engine_is_busy(tiny_llama_dir: Path) -> None:
    """The gateway polls GetLoad with a deadline: a node whose engine is in a long step (here
    held in a call) still answers, from the last step's snapshot, and the report counts what the
    engine did before."""

    async def body(stub, engine) -> None:
        await engine.reserve("held", list(range(10, 50)), GREEDY_PARAMS)
        gate = threading.Event()
        busy = asyncio.ensure_future(engine.call(lambda core: gate.wait(10)))
        try:
            report = await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=2)
            assert report.num_reserved == 1 and report.kv_blocks_used > 0
            assert not busy.done()
        finally:
            gate.set()
            await busy
        await engine.abort("held")
        await wait_idle(stub)

    run_with_node(tiny_llama_dir, body, with_engine=True)


def test_kv_source_is_refused_by_a_colocated_node(tiny_llama_dir: Path) -> None:
    async def body(stub) -> None:
        request = decode_pb2.GenerateRequest(
            prompt_token_ids=[1, 2], sampling=GREEDY, kv_source="prefill-0:50061"
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in stub.Generate(request, timeout=5):
                pass
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "kv_source" in error.value.details()

    run_with_node(tiny_llama_dir, body)


def test_the_process_serves_and_exits_0_on_sigterm(tiny_llama_dir: Path) -> None:
    port = free_ports(1)[0]  # outside the ephemeral range (deploy/local_ports.py)
    argv = [a if a != "0" else str(port) for a in colocated_argv(tiny_llama_dir)]
    process = subprocess.Popen(
        [sys.executable, "-m", "decode_node", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        channel = startup_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        # As the launcher tests allow: a node's start may wait on the native kernels' build
        # (another checkout's build in the shared cache took this past 60 s on a 2-core host).
        deadline = time.monotonic() + 180
        while True:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "node did not become healthy in 180 s"
            time.sleep(0.2)
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        request = decode_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=GREEDY)
        events = list(stub.Generate(request, timeout=30))
        assert sum(len(e.tokens.token_ids) for e in events) == 8
        if host_takes_huge_page_heap():
            # The node restarted itself with glibc's heap on huge pages (services/host_memory.py).
            assert heap_is_huge_page_advised(process.pid)
        channel.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
