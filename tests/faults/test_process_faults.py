"""Fault injection over real processes on localhost: two prefill and two decode nodes (tiny
model, KV over UCX) behind a gateway, each a process of its own, started as the launcher starts
them (``deploy.commands``, ``deploy.supervisor``).

Each scenario checks three things: what the client sees (a completed answer through a retry,
or a clear error — never a hang past the request deadline); that the surviving services stay
healthy and serve the next request; and that every live node's KV blocks in use return to zero.
Killed nodes are restarted before the next scenario, so scenarios do not depend on each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from deploy.local_ports import free_ports
from deploy.topology import GatewaySpec, NodeGroup, Role, Topology
from gateway.text.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, prefill_pb2_grpc
from services.engine import LLM, SamplingParams
from support.process_cluster import ProcessCluster, completion_body

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

MAX_MODEL_LEN = 512
REQUEST_TIMEOUT_S = 8
NODE_ARGS = (
    ("kv-cache-memory", "8MiB"), ("max-model-len", str(MAX_MODEL_LEN)), ("drain-grace-s", "2"),
)  # fmt: skip
# prefill-0 pauses before the last message of each push, so a test can kill it mid-push, and
# computes 16 tokens a step, each at least 20 ms long, so a long prompt keeps it computing for a
# while on a host of any speed (its steps alone took a few ms once the CPU kernels got faster,
# and a test could no longer catch the request running).
PREFILL_0_ARGS = (
    "--test-kv-push-pause-s", "1.5", "--max-num-batched-tokens", "16",
    "--test-step-delay-s", "0.02",
)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[ProcessCluster]:
    # Consecutive ports per group: a topology numbers its nodes from a base port.
    base = free_ports(6, consecutive=True)[0]
    topology = Topology(
        model=str(tiny_llama_dir),
        served_model_name="tiny-llama",
        dtype="float32",  # the offline engine's, which some tests compare with
        kv_transport="ucx",
        host="127.0.0.1",
        prefill=NodeGroup(Role.PREFILL, count=2, base_grpc_port=base, args=NODE_ARGS),
        decode=NodeGroup(Role.DECODE, count=2, base_grpc_port=base + 2, args=NODE_ARGS),
        colocated=NodeGroup(Role.COLOCATED, count=0),
        gateway=GatewaySpec(
            http_port=base + 4,
            grpc_port=base + 5,
            args=(
                ("max-model-len", str(MAX_MODEL_LEN)),
                ("request-timeout-s", str(REQUEST_TIMEOUT_S)),
                ("health-interval-s", "0.3"),
                ("lease-ms", "4000"),
            ),
        ),
    )
    with ProcessCluster(topology, {"prefill-0": PREFILL_0_ARGS}) as cluster:
        yield cluster


@pytest.fixture
def healthy(cluster: ProcessCluster) -> Iterator[ProcessCluster]:
    """The cluster with every process alive before the test; zero blocks checked after it."""
    cluster.restart_dead()
    yield cluster
    cluster.wait_all_free()  # on every node still alive
    assert complete(cluster)["choices"][0]["finish_reason"] == "length"  # the survivors serve


def complete(cluster: ProcessCluster, prompt: list[int] | None = None, **extra) -> dict:
    response = httpx.post(
        f"{cluster.base_url}/v1/completions",
        json=completion_body(prompt or [5, 6, 7, 8], **extra),
        timeout=REQUEST_TIMEOUT_S + 5,
    )
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(cluster: ProcessCluster, request: dict, on_chunk=None) -> list[dict]:
    """Every SSE event of a streamed completion (``[DONE]`` as the string)."""
    events = []
    with httpx.stream(
        "POST", f"{cluster.base_url}/v1/completions", json={**request, "stream": True},
        timeout=REQUEST_TIMEOUT_S + 5,
    ) as response:  # fmt: skip
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
            if on_chunk is not None:
                on_chunk(events)
    return events


def test_decode_killed_before_the_first_token_is_retried(healthy: ProcessCluster) -> None:
    # Both decodes are idle, so the gateway tries decode-0 first until it learns that it died.
    # Its health poll must not learn that before a request does, or nothing would be retried:
    # for this test the gateway polls once at start and then not for ten minutes.
    with healthy.gateway_with("--health-interval-s", "600"):
        healthy.wait_gateway_ready()
        retries = healthy.gateway_counter("pdserve:request_retries_total")
        healthy.kill("decode-0")
        results = [complete(healthy, [10 + i, 11, 12, 13]) for i in range(3)]
        assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
        assert all(r["usage"]["completion_tokens"] == 8 for r in results)
        assert healthy.gateway_counter("pdserve:request_retries_total") == retries + 1


def test_decode_killed_after_tokens_ends_the_stream_with_an_error(healthy: ProcessCluster) -> None:
    killed: list[str] = []

    def kill_its_decode(events: list) -> None:
        if len(events) == 3 and not killed:
            used = healthy.blocks_in_use()
            [serving] = [name for name in ("decode-0", "decode-1") if used[name]]
            healthy.kill(serving)
            killed.append(serving)

    events = stream_events(healthy, completion_body([20, 21, 22], max_tokens=400), kill_its_decode)
    assert killed
    finish = [e for e in events if isinstance(e, dict) and e.get("choices")][-1]
    assert finish["choices"][0]["finish_reason"] == "error"
    assert any(isinstance(e, dict) and "error" in e for e in events)
    assert events[-1] == "[DONE]"


def test_prefill_killed_during_its_push_is_retried_on_the_other(healthy: ProcessCluster) -> None:
    """prefill-0 pauses 1.5 s before the last message of every push: kill it then."""
    results: dict = {}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 5) as client:
            task = asyncio.create_task(
                client.post(
                    f"{healthy.base_url}/v1/completions", json=completion_body(list(range(30, 90)))
                )
            )
            await asyncio.sleep(0.8)  # routed (to prefill-0: idle, listed first) and pushing
            healthy.kill("prefill-0")
            results["response"] = await task

    asyncio.run(run())
    response = results["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8


def test_a_stopped_node_never_hangs_a_request_past_its_deadline(healthy: ProcessCluster) -> None:
    healthy.kill("decode-0", signal.SIGSTOP)
    healthy.kill("decode-1", signal.SIGSTOP)
    try:
        started = time.monotonic()
        response = httpx.post(
            f"{healthy.base_url}/v1/completions", json=completion_body([40, 41]), timeout=60
        )
        elapsed = time.monotonic() - started
        assert response.status_code in (503, 504), response.text
        assert "error" in response.json()
        assert elapsed < REQUEST_TIMEOUT_S + 3
    finally:
        healthy.kill("decode-0", signal.SIGCONT)
        healthy.kill("decode-1", signal.SIGCONT)
        # Their streams were ended once their polls went unanswered; they are routed to again
        # from the first poll they answer, which may come after the next request.
        healthy.wait_gateway_ready()


def test_clients_that_disconnect_at_random_points_leak_nothing(healthy: ProcessCluster) -> None:
    rng = random.Random(3)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        request = completion_body(
            [50 + i, 51, 52, 53] * rng.randint(1, 20), max_tokens=64, stream=True
        )
        cut_after = rng.randint(0, 6)
        with contextlib.suppress(httpx.HTTPError):
            async with client.stream("POST", "/v1/completions", json=request) as response:
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= cut_after:
                        break

    async def run() -> None:
        async with httpx.AsyncClient(base_url=healthy.base_url, timeout=30) as client:
            await asyncio.gather(*(one(client, i) for i in range(16)))

    asyncio.run(run())


def test_gateway_restarted_while_streams_are_open(healthy: ProcessCluster) -> None:
    opened = []

    async def reader(client: httpx.AsyncClient) -> None:
        request = completion_body([60, 61, 62], max_tokens=400, stream=True)
        with contextlib.suppress(httpx.HTTPError):
            async with client.stream("POST", "/v1/completions", json=request) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        opened.append(1)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=healthy.base_url, timeout=30) as client:
            tasks = [asyncio.create_task(reader(client)) for _ in range(4)]
            while len(opened) < 8:
                await asyncio.sleep(0.05)
            healthy.kill("gateway")
            await asyncio.wait_for(asyncio.gather(*tasks), 30)

    asyncio.run(run())
    healthy.restart_dead()  # the nodes freed the dropped streams; a new gateway serves


def test_a_short_soak_loses_and_leaks_nothing(healthy: ProcessCluster) -> None:
    """benchmarks/soak.py for a few seconds: random streams, a fifth of them cancelled.

    Load sized to the request deadline: prefill-0 holds every push 1.5 s and computes 16 tokens
    a step (20 ms or more each), so 8 streams of up to 120 tokens queued there past the 8 s
    deadline (an HTTP 504 now and then on a busy 2-core host): the deadline working, not a loss
    or a leak."""
    spec = importlib.util.spec_from_file_location("soak", REPO / "benchmarks/soak.py")
    soak = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = soak  # dataclasses look their module up while the class is built
    spec.loader.exec_module(soak)
    args = soak.build_parser().parse_args(
        ["--base-url", healthy.base_url, "--model", "tiny-llama", "--duration-s", "12",
         "--concurrency", "4", "--max-input-len", "64", "--max-output-len", "32",
         *(f"--node={name}={healthy.address(name)}" for name in healthy.node_names),
         *(f"--process={name}={healthy.pid(name)}" for name in [*healthy.node_names, "gateway"])],
    )  # fmt: skip
    report = asyncio.run(soak.soak(args))
    assert report.errors == {}, healthy.log.getvalue()[-3000:]
    assert report.completed > 0 and report.cancelled > 0
    assert set(report.blocks_in_use_end) == set(healthy.node_names)
    assert not any(report.blocks_in_use_end.values())
    assert set(report.rss_growth_mib) == {*healthy.node_names, "gateway"}


def test_greedy_text_through_processes_equals_the_single_engine(
    healthy: ProcessCluster, tiny_llama_dir: Path
) -> None:
    """The baseline the faults are measured against: gateway, prefill and decode processes,
    KV over UCX, give the single-process engine's greedy text."""
    rng = random.Random(8)
    prompts = [[rng.randrange(16, 4000) for _ in range(n)] for n in (5, 40, 130)]
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = offline.generate(prompts, greedy)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=healthy.base_url, timeout=30) as client:
            return await asyncio.gather(
                *(
                    client.post("/v1/completions", json=completion_body(p, max_tokens=8))
                    for p in prompts
                )
            )

    responses = asyncio.run(run())
    tokenizer = Tokenizer.from_model_dir(tiny_llama_dir)
    for response, output in zip(responses, outputs, strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == tokenizer.decode(output.token_ids)


def test_decode_killed_during_the_push_cuts_the_transfer(healthy: ProcessCluster) -> None:
    """The UCX peer of a transfer in flight vanishes: prefill-0 is mid-push (paused before its
    last message) when the decode node it pushes to is killed. The push must not hang the
    prefill node or leak its blocks (checked after the test), and the request completes on the
    other decode."""
    results: dict = {}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 5) as client:
            task = asyncio.create_task(
                client.post(
                    f"{healthy.base_url}/v1/completions",
                    json=completion_body(list(range(130, 190))),
                )
            )
            # A prompt no node has seen: no prefix affinity, so prefill-0 (idle, listed first)
            # serves it, with whichever decode the load order picks.
            await asyncio.sleep(0.8)
            used = await asyncio.to_thread(healthy.blocks_in_use)
            results["used"] = used
            [serving] = [name for name in ("decode-0", "decode-1") if used[name]]
            healthy.kill(serving)
            results["response"] = await task

    asyncio.run(run())
    assert results["used"]["prefill-0"] > 0, results["used"]  # killed while pushing
    response = results["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8


def test_prefill_killed_while_it_computes_is_retried_on_the_other(healthy: ProcessCluster) -> None:
    """prefill-0 computes 16 tokens a step, each at least 20 ms: a 480-token prompt runs 30
    steps there, 0.6 s or more. It is killed as soon as its engine reports the request running
    (computing, not yet pushing)."""
    results: dict = {}

    async def running_on_prefill_0() -> bool:
        async with grpc.aio.insecure_channel(healthy.address("prefill-0")) as channel:
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            report = await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)
            return report.num_running > 0

    async def run() -> None:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 5) as client:
            prompt = list(range(1000, 1480))  # unseen: no prefix affinity
            task = asyncio.create_task(
                client.post(f"{healthy.base_url}/v1/completions", json=completion_body(prompt))
            )
            for _ in range(500):
                if await running_on_prefill_0():
                    break
                await asyncio.sleep(0.002)
            else:
                raise AssertionError("the request never ran on prefill-0")
            healthy.kill("prefill-0")
            results["response"] = await task

    asyncio.run(run())
    response = results["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
