"""Prefill and decode nodes as separate processes, KV pages moved over UCX (shared memory on
this host) and over the shm transport (memfd), driven the way the gateway will drive them."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.local_ports import free_ports
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.engine import LLM, SamplingParams
from support.huge_page_heap import heap_is_huge_page_advised, host_takes_huge_page_heap
from support.startup_channel import startup_channel

# Node processes and a UCX context each: seconds per test.
pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
GREEDY = common_pb2.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


class NodeProcess:
    def __init__(
        self, module: str, role: str, model_dir: Path, kv_memory: str, *extra: str, kv="ucx"
    ) -> None:
        self.port = free_ports(1)[0]
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--role",
                role,
                "--model",
                str(model_dir),
                "--dtype",
                "float32",
                "--host",
                "127.0.0.1",
                "--grpc-port",
                str(self.port),
                "--kv-transport",
                kv,
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--kv-cache-memory",
                kv_memory,
                "--drain-grace-s",
                "2",
                *extra,
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.address = f"127.0.0.1:{self.port}"
        self.channel = startup_channel(self.address)

    def wait_healthy(self, timeout_s: float = 90) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stdout.read()
            try:
                request = health_pb2.HealthCheckRequest(service="")
                if (
                    health.Check(request, timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.address} not healthy in {timeout_s} s")

    def stop(self) -> int:
        self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module", params=["ucx", "shm"])
def nodes(tiny_llama_dir: Path, request: pytest.FixtureRequest):
    prefill = NodeProcess("prefill_node", "prefill", tiny_llama_dir, "3MiB", kv=request.param)
    decode = NodeProcess("decode_node", "decode", tiny_llama_dir, "5MiB", kv=request.param)
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        yield prefill, decode
    finally:
        prefill_code, decode_code = prefill.stop(), decode.stop()
    assert decode_code == 0  # drained on SIGTERM
    assert prefill_code in (0, -signal.SIGKILL)  # the last test kills it


def open_stream(
    prefill: NodeProcess, decode: NodeProcess, request_id, prompt, lease_ms=20_000, policy=0
):
    decode_stub = decode_pb2_grpc.DecodeServiceStub(decode.channel)
    return decode_stub.Generate(
        decode_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=GREEDY,
            kv_source=prefill.address,
            lease_ms=lease_ms,
            on_kv_failure=policy,
        ),
        timeout=60,
    )


def prefill_into(prefill: NodeProcess, decode: NodeProcess, request_id, prompt, reservation):
    return prefill_pb2_grpc.PrefillServiceStub(prefill.channel).Prefill(
        prefill_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=GREEDY,
            destination=reservation,
            decode_target=decode.address,
        ),
        timeout=60,
    )


def disaggregated_generate(prefill: NodeProcess, decode: NodeProcess, request_id, prompt):
    stream = open_stream(prefill, decode, request_id, prompt)
    reservation = next(stream).reservation
    result = prefill_into(prefill, decode, request_id, prompt, reservation)
    tokens = [result.first_token_id]
    for event in stream:
        tokens.extend(event.tokens.token_ids)
    return tokens, result


def blocks_in_use(node: NodeProcess) -> int:
    for stub_class in (decode_pb2_grpc.DecodeServiceStub, prefill_pb2_grpc.PrefillServiceStub):
        try:
            report = stub_class(node.channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5)
            return report.kv_blocks_used
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
    raise AssertionError("no GetLoad")


def wait_free(node: NodeProcess) -> None:
    for _ in range(300):
        if blocks_in_use(node) == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"{node.address} still holds {blocks_in_use(node)} blocks")


def test_concurrent_requests_over_ucx_equal_the_single_engine(nodes, tiny_llama_dir) -> None:
    prefill, decode = nodes
    if host_takes_huge_page_heap():  # both entry points restart with it (host_memory.py)
        assert heap_is_huge_page_advised(prefill.process.pid)
        assert heap_is_huge_page_advised(decode.process.pid)
    rng = random.Random(21)
    prompts = [[rng.randrange(5, 4096) for _ in range(n)] for n in (3, 16, 45, 120, 200, 77)]
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(prompts, params)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(disaggregated_generate, prefill, decode, f"u{i}", p)
            for i, p in enumerate(prompts)
        ]
        results = [f.result() for f in futures]
    assert [tokens for tokens, _ in results] == expected
    assert all(result.kv_bytes_pushed > 0 for _, result in results)
    wait_free(prefill)
    wait_free(decode)


def test_a_killed_prefill_node_leaves_no_decode_blocks(nodes, tiny_llama_dir) -> None:
    prefill, decode = nodes
    decode_stub = decode_pb2_grpc.DecodeServiceStub(decode.channel)
    stream = decode_stub.Generate(
        decode_pb2.GenerateRequest(
            request_id="orphaned",
            prompt_token_ids=list(range(20, 90)),
            sampling=GREEDY,
            kv_source=prefill.address,
            lease_ms=500,
        ),
        timeout=30,
    )
    assert next(stream).WhichOneof("event") == "reservation"
    assert blocks_in_use(decode) > 0
    prefill.process.send_signal(signal.SIGKILL)  # the commit will never come
    with pytest.raises(grpc.RpcError) as error:
        next(stream)
    assert error.value.code() == grpc.StatusCode.ABORTED
    wait_free(decode)
    # The decode node stays healthy and serves the next (colocated-style) check.
    health = health_pb2_grpc.HealthStub(decode.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_a_prefill_node_killed_during_the_push(tiny_llama_dir: Path) -> None:
    """SIGKILL while pages are moving over UCX (the push holds its last message back): the
    decode node frees both reservations at their lease (UCX over shared memory cannot see a
    dead peer, so the lease is what notices); the FAIL request ends ABORTED, the RECOMPUTE one
    streams every token from the decode node; a replacement prefill node then serves with it,
    and both report zero blocks in use."""
    prompts = {"fail": list(range(30, 150)), "recompute": list(range(200, 400))}
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = offline.generate(list(prompts.values()), params)
    expected = {name: out.token_ids for name, out in zip(prompts, outputs, strict=True)}
    paused = NodeProcess(
        "prefill_node", "prefill", tiny_llama_dir, "3MiB", "--test-kv-push-pause-s", "30"
    )
    decode = NodeProcess("decode_node", "decode", tiny_llama_dir, "5MiB")
    replacement = None
    try:
        paused.wait_healthy()
        decode.wait_healthy()
        policies = {
            "fail": decode_pb2.KV_FAILURE_POLICY_FAIL,
            "recompute": decode_pb2.KV_FAILURE_POLICY_RECOMPUTE,
        }
        streams = {
            name: open_stream(paused, decode, name, prompt, lease_ms=3000, policy=policies[name])
            for name, prompt in prompts.items()
        }
        reservations = {name: next(stream).reservation for name, stream in streams.items()}
        with ThreadPoolExecutor(2) as pool:
            pushes = [
                pool.submit(prefill_into, paused, decode, name, prompts[name], reservations[name])
                for name in prompts
            ]
            time.sleep(1.0)  # computed in milliseconds; now inside the paused pushes
            assert not any(push.done() for push in pushes)
            assert blocks_in_use(decode) > 0 and blocks_in_use(paused) > 0
            paused.process.send_signal(signal.SIGKILL)
            for push in pushes:
                with pytest.raises(grpc.RpcError) as error:
                    push.result()
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as error:
            next(streams["fail"])
        assert error.value.code() == grpc.StatusCode.ABORTED
        assert "lease expired" in error.value.details()
        events = list(streams["recompute"])
        assert events[0].WhichOneof("event") == "recomputing"
        assert "lease expired" in events[0].recomputing.reason
        tokens = [t for event in events[1:-1] for t in event.tokens.token_ids]
        assert tokens == expected["recompute"]
        assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        wait_free(decode)
        replacement = NodeProcess("prefill_node", "prefill", tiny_llama_dir, "3MiB")
        replacement.wait_healthy()
        tokens, _ = disaggregated_generate(replacement, decode, "next", prompts["fail"])
        assert tokens == expected["fail"]
        wait_free(replacement)
        wait_free(decode)
    finally:
        paused.stop()
        assert decode.stop() == 0
        if replacement is not None:
            assert replacement.stop() == 0
