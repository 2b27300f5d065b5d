"""A slow prefill node under a burst, over real processes (issue 13): one prefill node slowed by
the ``--test-step-delay-s`` knob and computing 16 prompt tokens a step, one decode node with a
batch of 4 and room for 6 waiting reservations, a 1 s liveness lease at the gateway.

Before the lease measured liveness, every request queued on the prefill node longer than the
lease failed with HTTP 503 (``lease expired without a commit``). Now each request either
completes or is refused with 429 before any token; nothing else; and both nodes end with no
block in use. A prompt whose prefill alone outlasts the lease completes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deploy.local_ports import free_ports
from deploy.topology import GatewaySpec, NodeGroup, Role, Topology
from support.process_cluster import ProcessCluster, completion_body

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
LEASE_MS = 1000
PREFILL_ARGS = ("--test-step-delay-s", "0.1", "--max-num-batched-tokens", "16")
DECODE_ARGS = ("--max-num-seqs", "4", "--max-waiting-reservations", "6")


@pytest.fixture(scope="module")
def slow(tiny_llama_dir: Path) -> Iterator[ProcessCluster]:
    base = free_ports(4, consecutive=True)[0]
    node_args = (("kv-cache-memory", "8MiB"), ("max-model-len", str(MAX_MODEL_LEN)),
                 ("drain-grace-s", "2"))  # fmt: skip
    topology = Topology(
        model=str(tiny_llama_dir),
        served_model_name="tiny-llama",
        dtype="float32",  # the offline engine's, which some tests compare with
        kv_transport="ucx",
        host="127.0.0.1",
        prefill=NodeGroup(Role.PREFILL, count=1, base_grpc_port=base, args=node_args),
        decode=NodeGroup(Role.DECODE, count=1, base_grpc_port=base + 1, args=node_args),
        colocated=NodeGroup(Role.COLOCATED, count=0),
        gateway=GatewaySpec(
            http_port=base + 2,
            grpc_port=base + 3,
            args=(
                ("max-model-len", str(MAX_MODEL_LEN)),
                ("request-timeout-s", "300"),
                ("health-interval-s", "0.3"),
                ("lease-ms", str(LEASE_MS)),
            ),
        ),
    )
    extra = {"prefill-0": PREFILL_ARGS, "decode-0": DECODE_ARGS}
    with ProcessCluster(topology, extra) as cluster:
        yield cluster


async def _post(client: httpx.AsyncClient, request: dict) -> httpx.Response:
    return await client.post("/v1/completions", json=request)


def test_a_prefill_longer_than_the_lease_completes(slow: ProcessCluster) -> None:
    # 400 prompt tokens at 16 a step, each step 0.1 s longer: 25 steps, well past the 1 s lease.
    prompt = [(7 * i) % 500 + 3 for i in range(400)]
    response = httpx.post(
        f"{slow.base_url}/v1/completions", json=completion_body(prompt, max_tokens=8), timeout=300
    )
    assert response.status_code == 200, slow.log.getvalue()[-3000:]
    assert response.json()["usage"]["completion_tokens"] == 8
    slow.wait_all_free()


def test_a_burst_past_the_batch_completes_or_is_refused_with_429(
    slow: ProcessCluster,
) -> None:
    # 16 prompts of 40 tokens queue on the prefill node (40 slowed steps in all, past the lease
    # many times over) behind a decode batch of 4 and 6 waiting places.
    requests = [
        completion_body([10 + i, *range(20, 59)], max_tokens=8, stream=i % 2 == 1)
        for i in range(16)
    ]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=slow.base_url, timeout=300) as client:
            return await asyncio.gather(*(_post(client, r) for r in requests))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, (statuses, slow.log.getvalue()[-3000:])
    assert statuses.count(200) >= 4  # at least the first batch
    for request, response in zip(requests, responses, strict=True):
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"] == "rate_limit_error"
        elif request["stream"]:
            assert response.text.rstrip().endswith("data: [DONE]")
            assert '"finish_reason":"length"' in response.text.replace(" ", "")
        else:
            assert response.json()["usage"]["completion_tokens"] == 8
    slow.wait_all_free()
    assert slow.blocks_in_use() == {"prefill-0": 0, "decode-0": 0}
