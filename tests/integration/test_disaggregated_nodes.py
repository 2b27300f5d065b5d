"""A prefill node and a decode node over real gRPC on localhost, KV pages moved by a transport.

The client plays the gateway's part of design §2: open Decode.Generate (its first event is the
KV reservation), call Prefill with that reservation as the destination, take the first token
from the prefill result and tokens 2..N from the decode stream. Both nodes run in this process
with the loopback transport (the UCX transport between processes has its own suite).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from decode_node.role import decode_services
from decode_node.servicer import DecodeServicer
from decode_node.transfers import TransferState
from deploy.local_ports import free_ports
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from prefill_node.role import prefill_services
from prefill_node.servicer import PrefillServicer
from services.engine import LLM, SamplingParams
from services.node.config import Role, parse_node_config
from services.node.runtime import start_node
from support.node_argv import node_argv

MAX_MODEL_LEN = 256
GREEDY = common_pb2.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def argv(model_dir: Path, role: str, kv_memory: str, *extra: str) -> list[str]:
    flags = node_argv(model_dir, role, kv_memory=kv_memory, max_model_len=MAX_MODEL_LEN)
    return [*extra, *flags]


class Cluster:
    def __init__(self, prefill, decode) -> None:
        (self.prefill_server, self.prefill_engine), (self.decode_server, self.decode_engine) = (
            prefill,
            decode,
        )
        self.decode_address = f"127.0.0.1:{self.decode_server.port}"
        self.prefill_channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.prefill_server.port}")
        self.decode_channel = grpc.aio.insecure_channel(self.decode_address)
        self.prefill = prefill_pb2_grpc.PrefillServiceStub(self.prefill_channel)
        self.decode = decode_pb2_grpc.DecodeServiceStub(self.decode_channel)

    async def generate(self, request_id: str, prompt: list[int], sampling=GREEDY, tamper=None):
        """The gateway's two legs; returns (tokens, finished event)."""
        tokens, _, finished = await self.generate_full(request_id, prompt, sampling, tamper)
        return tokens, finished

    async def reserve(
        self, request_id: str, prompt: list[int], sampling=GREEDY, lease_ms: int = 5000
    ):
        """The gateway's first leg: (the open Decode.Generate stream, its KV reservation)."""
        stream = self.decode.Generate(
            decode_pb2.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                kv_source="prefill",
                lease_ms=lease_ms,
            ),
            timeout=30,
        )
        return stream, (await stream.read()).reservation

    def prefill_into(self, request_id: str, prompt: list[int], reservation, sampling=GREEDY):
        """The gateway's second leg's request: prefill ``prompt`` into ``reservation``."""
        return prefill_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            destination=reservation,
            decode_target=self.decode_address,
        )

    async def generate_full(self, request_id: str, prompt: list[int], sampling=GREEDY, tamper=None):
        """The gateway's two legs; returns (tokens, prefill result, finished event)."""
        stream, reservation = await self.reserve(request_id, prompt, sampling)
        if tamper is not None:
            tamper(reservation)
        try:
            result = await self.prefill.Prefill(
                self.prefill_into(request_id, prompt, reservation, sampling), timeout=30
            )
        except grpc.aio.AioRpcError:
            stream.cancel()
            raise
        tokens, finished = [result.first_token_id], None
        while (event := await stream.read()) is not grpc.aio.EOF:
            if event.WhichOneof("event") == "tokens":
                tokens.extend(event.tokens.token_ids)
            else:
                finished = event.finished
        return tokens, result, finished

    async def blocks_in_use(self) -> tuple[int, int]:
        request = common_pb2.GetLoadRequest()
        prefill = await self.prefill.GetLoad(request, timeout=5)
        decode = await self.decode.GetLoad(request, timeout=5)
        return prefill.kv_blocks_used, decode.kv_blocks_used

    async def wait_all_free(self) -> None:
        for _ in range(300):
            if await self.blocks_in_use() == (0, 0):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"blocks still in use: {await self.blocks_in_use()}")

    async def close(self) -> None:
        await self.prefill_channel.close()
        await self.decode_channel.close()
        for server, engine in (
            (self.prefill_server, self.prefill_engine),
            (self.decode_server, self.decode_engine),
        ):
            await server.drain()
            engine.shutdown()


def run_cluster(
    model_dir: Path,
    body,
    metrics_ports: tuple[int, int] | None = None,
    prefill_flags: tuple[str, ...] = (),
    kv_memory: tuple[str, str] = ("3MiB", "5MiB"),
    node_flags: tuple[str, ...] = (),
) -> None:
    """``prefill_flags`` go to the prefill node only, ``node_flags`` to both."""
    prefill_extra, decode_extra = (
        (("--metrics-port", str(metrics_ports[0])), ("--metrics-port", str(metrics_ports[1])))
        if metrics_ports
        else ((), ())
    )
    prefill_extra = (*prefill_extra, *prefill_flags, *node_flags)
    decode_extra = (*decode_extra, *node_flags)

    async def main() -> None:
        prefill = await start_node(
            parse_node_config(
                argv(model_dir, "prefill", kv_memory[0], *prefill_extra), {}, role=Role.PREFILL
            ),
            prefill_services,
        )
        decode = await start_node(
            parse_node_config(
                argv(model_dir, "decode", kv_memory[1], *decode_extra), {}, role=Role.DECODE
            ),
            decode_services,
        )
        cluster = Cluster(prefill, decode)
        try:
            await body(cluster)
        finally:
            await cluster.close()

    asyncio.run(main())


def test_concurrent_disaggregated_requests_equal_the_single_engine(tiny_llama_dir: Path) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 4096) for _ in range(n)] for n in (1, 16, 17, 70, 130, 40)]
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(prompts, params)]

    async def body(cluster: Cluster) -> None:
        results = await asyncio.gather(
            *(cluster.generate(f"req-{i}", p) for i, p in enumerate(prompts))
        )
        assert [tokens for tokens, _ in results] == expected
        assert all(f.finish_reason == common_pb2.FINISH_REASON_LENGTH for _, f in results)
        assert all(f.usage.completion_tokens == 10 for _, f in results)
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body)


def test_an_fp8_kv_cache_moves_between_nodes_and_equals_the_single_engine(
    tiny_llama_dir: Path,
) -> None:
    """Pages of a 1-byte dtype: the decode node's tokens are those of one engine whose cache
    holds the same fp8 E5M2 K/V (and they differ from a bf16 cache's somewhere, or the
    dtype would not be in use)."""
    rng = random.Random(12)
    prompts = [[rng.randrange(5, 4096) for _ in range(n)] for n in (16, 17, 70, 130)]
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)

    def offline(kv_cache_dtype: str) -> list[list[int]]:
        llm = LLM(
            tiny_llama_dir,
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=MAX_MODEL_LEN,
        )
        return [o.token_ids for o in llm.generate(prompts, params)]

    expected = offline("fp8_e5m2")

    async def body(cluster: Cluster) -> None:
        assert cluster.prefill_engine.engine.kv_layout.dtype == "fp8_e5m2"
        assert cluster.decode_engine.engine.kv_layout.dtype == "fp8_e5m2"
        results = await asyncio.gather(
            *(cluster.generate(f"fp8-{i}", p) for i, p in enumerate(prompts))
        )
        assert [tokens for tokens, _ in results] == expected
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body, node_flags=("--kv-cache-dtype", "fp8_e5m2"))
    assert expected != offline("bfloat16")


def test_a_prefix_the_decode_node_holds_is_not_pushed_again(tiny_llama_dir: Path) -> None:
    """A second prompt that shares a first's prefix (a system prompt, a chat's earlier turns):
    the decode node's reservation takes those blocks from its prefix cache, the prefill node
    pushes only the rest, and the tokens are still the single engine's."""
    rng = random.Random(13)

    async def body(cluster: Cluster) -> None:
        block_size = cluster.decode_engine.engine.kv_layout.block_size
        shared = [rng.randrange(5, 4096) for _ in range(3 * block_size + 5)]
        prompts = [shared + [rng.randrange(5, 4096) for _ in range(n)] for n in (7, 40)]
        offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        expected = [o.token_ids for o in offline.generate(prompts, params)]
        seen: list[int] = []
        results = []
        for i, prompt in enumerate(prompts):  # in turn: the first must finish to be cached
            tokens, result, _ = await cluster.generate_full(
                f"shared-{i}", prompt, tamper=lambda r: seen.append(r.cached_blocks)
            )
            results.append((tokens, result))
        assert [tokens for tokens, _ in results] == expected
        assert seen == [0, 3]
        blocks = [-(-len(p) // block_size) for p in prompts]
        per_block = results[0][1].kv_bytes_pushed // blocks[0]
        assert per_block > 0 and results[0][1].kv_bytes_pushed == per_block * blocks[0]
        assert results[1][1].kv_bytes_pushed == per_block * (blocks[1] - 3)
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body)


def test_a_reservation_that_leaves_nothing_to_push_is_refused(tiny_llama_dir: Path) -> None:
    def tamper(reservation) -> None:
        reservation.cached_blocks = len(reservation.block_ids)

    async def body(cluster: Cluster) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await cluster.generate("all-cached", list(range(10, 40)), tamper=tamper)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "destination.cached_blocks" in error.value.details()
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body)


def test_fingerprint_mismatch_is_refused_before_any_byte_moves(tiny_llama_dir: Path) -> None:
    def tamper(reservation) -> None:
        reservation.layout_fingerprint = "0" * 16

    async def body(cluster: Cluster) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await cluster.generate("mismatch", list(range(10, 40)), tamper=tamper)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "layout_fingerprint" in error.value.details()
        await cluster.wait_all_free()  # the cancelled decode stream freed its reservation

    run_cluster(tiny_llama_dir, body)


def test_nodes_with_different_kv_cache_dtypes_refuse_each_other(tiny_llama_dir: Path) -> None:
    """A float32 KV cache on the prefill node, the default (bfloat16 on CPU) on the decode node:
    their layouts differ, so the push is refused before any byte moves."""

    async def body(cluster: Cluster) -> None:
        assert cluster.prefill_engine.engine.kv_layout.dtype == "float32"
        assert cluster.decode_engine.engine.kv_layout.dtype == "bfloat16"
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await cluster.generate("kv-dtypes", list(range(10, 40)))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "layout_fingerprint" in error.value.details()
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body, prefill_flags=("--kv-cache-dtype", "float32"))


def test_a_reservation_whose_commit_never_comes_expires(tiny_llama_dir: Path) -> None:
    async def body(cluster: Cluster) -> None:
        stream = cluster.decode.Generate(
            decode_pb2.GenerateRequest(
                request_id="orphan",
                prompt_token_ids=list(range(10, 50)),
                sampling=GREEDY,
                kv_source="prefill",
                lease_ms=200,
            ),
            timeout=30,
        )
        assert (await stream.read()).WhichOneof("event") == "reservation"
        assert (await cluster.blocks_in_use())[1] > 0
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stream.read()
        assert error.value.code() == grpc.StatusCode.ABORTED
        assert "lease expired" in error.value.details()
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body)


def test_a_renew_answered_after_the_commit_leaves_the_prefill_whole(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, prefill, push and commit of a short prompt can all end while a renew is in
    flight; its answer ("committed" or "unknown") then comes after the commit. That must not
    stop a request whose push already began (it once cancelled the finished Prefill call, which
    then never answered: the gateway waited on it for good). Here the decode node holds each
    "started" renew until the commit has ended the transfer, and the prefill node lingers in
    its commit step, so the late refusal lands while the Prefill call is still running."""
    open_states = (TransferState.RESERVED, TransferState.RECEIVING)
    renew, commit = DecodeServicer.RenewKv, PrefillServicer._commit

    late: list[str] = []  # renews answered once their transfer had ended

    async def late_renew(self, request, context):
        for _ in range(150):  # under the keep-alive's 1 s renew deadline
            transfer = self.transfers.transfers.get(request.transfer_id)
            if transfer is None or transfer.state not in open_states:
                late.append(request.transfer_id)
                break
            if not request.started:
                break
            await asyncio.sleep(0.005)
        return await renew(self, request, context)

    async def lingering_commit(self, *args, **kwargs):
        await commit(self, *args, **kwargs)
        await asyncio.sleep(0.3)

    monkeypatch.setattr(DecodeServicer, "RenewKv", late_renew)
    monkeypatch.setattr(PrefillServicer, "_commit", lingering_commit)
    prompt = list(range(10, 50))
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    [expected] = [o.token_ids for o in offline.generate([prompt], params)]

    async def body(cluster: Cluster) -> None:
        tokens, finished = await asyncio.wait_for(cluster.generate("late-renew", prompt), 20)
        assert late, "no renew was answered after the commit: the race was not exercised"
        assert tokens == expected
        assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        await cluster.wait_all_free()

    # Three 16-token chunks of at least 50 ms each: the "started" renew goes out after the
    # first, well before the push begins, on any host.
    flags = ("--max-num-batched-tokens", "16", "--test-step-delay-s", "0.05")
    run_cluster(tiny_llama_dir, body, prefill_flags=flags)


def test_a_transfer_ended_on_the_decode_node_aborts_the_prefill_call(tiny_llama_dir: Path) -> None:
    """The caller leaves the decode stream while the prompt is computing on a slow prefill
    node: the next renew is refused, and the Prefill call must end with a status (ABORTED, which
    the gateway retries), never stay open until its deadline."""

    async def body(cluster: Cluster) -> None:
        prompt = list(range(10, 200))
        stream, reservation = await cluster.reserve("left", prompt, lease_ms=300)
        prefill = asyncio.ensure_future(
            cluster.prefill.Prefill(cluster.prefill_into("left", prompt, reservation), timeout=60)
        )
        await asyncio.sleep(0.2)
        stream.cancel()
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await prefill
        assert error.value.code() == grpc.StatusCode.ABORTED
        assert "ended transfer" in error.value.details()
        assert time.monotonic() - started < 30  # well before the call's own deadline
        await cluster.wait_all_free()

    # Slowed so that the prompt is still computing when the stream closes, on any host:
    # 12 chunks of 16 tokens, each step at least 0.1 s.
    flags = ("--max-num-batched-tokens", "16", "--test-step-delay-s", "0.1")
    run_cluster(tiny_llama_dir, body, prefill_flags=flags)


def test_bad_requests_and_a_full_decode(tiny_llama_dir: Path) -> None:
    async def body(cluster: Cluster) -> None:
        bad = common_pb2.SamplingParams(top_p=2.0)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await cluster.generate("bad", [1, 2, 3], sampling=bad)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.top_p" in error.value.details()
        # A prompt the decode node has no room for is refused with RESOURCE_EXHAUSTED.
        streams = []
        for i in range(20):
            stream = cluster.decode.Generate(
                decode_pb2.GenerateRequest(
                    request_id=f"fill-{i}",
                    prompt_token_ids=[7] * 250,
                    sampling=GREEDY,
                    kv_source="prefill",
                ),
                timeout=30,
            )
            try:
                await stream.read()
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                break
            streams.append(stream)
        else:
            raise AssertionError("the decode node never ran out of room")
        for stream in streams:
            stream.cancel()
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body)


def test_both_nodes_export_prometheus_metrics(tiny_llama_dir: Path) -> None:
    ports = tuple(free_ports(2))

    async def body(cluster: Cluster) -> None:
        for i in range(3):
            await cluster.generate(f"m{i}", list(range(10 + i, 60 + i)))
        await cluster.wait_all_free()
        await asyncio.sleep(0.6)  # one gauge refresh
        prefill, decode = scrape(ports[0]), scrape(ports[1])
        assert re.search(
            r'pdserve:kv_transfer_bytes_count\{[^}]*role="prefill"[^}]*\} 3\.0', prefill
        )
        assert re.search(r"pdserve:time_to_first_token_seconds_count\{[^}]*\} 3\.0", prefill)
        assert "pdserve:kv_transport_info{" in prefill and 'lanes="' in prefill
        assert re.search(
            r'pdserve:request_success_total\{[^}]*finished_reason="length"[^}]*\} 3\.0', decode
        )
        for name in ("kv_cache_usage_perc", "num_requests_running", "prefix_cache_hit_rate"):
            assert re.search(rf'pdserve:{name}\{{[^}}]*role="decode"[^}}]*\}} 0\.0', decode), name

    run_cluster(tiny_llama_dir, body, metrics_ports=ports)


def test_cancelling_both_legs_mid_prefill_frees_both_nodes(tiny_llama_dir: Path) -> None:
    """The gateway's client disconnects 10 ms into the prefill: it may still be computing,
    pushing or committing (the tiny model is fast, so which one varies); in every case both
    nodes end with no blocks in use and keep serving."""

    async def body(cluster: Cluster) -> None:
        prompt = list(range(10, 250))  # several 64-token chunks on the prefill node
        stream, reservation = await cluster.reserve("gone", prompt)
        prefill_call = cluster.prefill.Prefill(
            cluster.prefill_into("gone", prompt, reservation), timeout=30
        )
        await asyncio.sleep(0.01)
        prefill_call.cancel()
        stream.cancel()
        await cluster.wait_all_free()
        tokens, _ = await cluster.generate("after", [1, 2, 3])  # both nodes still serve
        assert len(tokens) == 10

    run_cluster(tiny_llama_dir, body)


def test_prefill_keeps_min_tokens_for_the_first_token(tiny_llama_dir: Path) -> None:
    prompt = list(range(30, 60))
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    [greedy] = offline.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    stop_id = greedy.token_ids[0]

    async def body(cluster: Cluster) -> None:
        def prefill_only(min_tokens: int):
            sampling = common_pb2.SamplingParams(
                max_tokens=5, min_tokens=min_tokens, temperature=0.0, stop_token_ids=[stop_id]
            )
            request = prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling=sampling)
            return cluster.prefill.Prefill(request, timeout=10)

        stopped = await prefill_only(0)
        assert stopped.first_token_id == stop_id
        assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP
        held_back = await prefill_only(1)
        assert held_back.first_token_id != stop_id
        assert held_back.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body)


@pytest.mark.parametrize(
    ("tamper", "decode_target", "message"),
    [
        (lambda r: setattr(r.address, "worker_address", b"not json"), None, "worker_address"),
        (lambda r: setattr(r, "num_blocks_total", 1), None, "outside num_blocks_total"),
        (lambda r: r.block_ids.append(0), None, "destination.block_ids has"),
        (lambda r: setattr(r, "transfer_id", ""), None, "destination.transfer_id is empty"),
        (None, "", "decode_target is empty"),
    ],
)
def test_bad_destinations_are_invalid_argument(tiny_llama_dir, tamper, decode_target, message):
    async def body(cluster: Cluster) -> None:
        prompt = list(range(10, 50))
        stream = cluster.decode.Generate(
            decode_pb2.GenerateRequest(
                prompt_token_ids=prompt, sampling=GREEDY, kv_source="prefill"
            ),
            timeout=30,
        )
        reservation = (await stream.read()).reservation
        if tamper is not None:
            tamper(reservation)
        request = prefill_pb2.PrefillRequest(
            prompt_token_ids=prompt,
            sampling=GREEDY,
            destination=reservation,
            decode_target=cluster.decode_address if decode_target is None else decode_target,
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await cluster.prefill.Prefill(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details()
        stream.cancel()
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body)


def test_finished_carries_the_prefill_cache_hits_and_every_stage(tiny_llama_dir: Path) -> None:
    prompt = list(range(100, 170))  # 70 tokens: 4 full blocks of 16 can come from the cache

    async def body(cluster: Cluster) -> None:
        await cluster.generate("warm", prompt)
        _, result, finished = await cluster.generate_full("hit", prompt)
        assert result.cached_prompt_tokens == 64
        assert finished.usage.cached_prompt_tokens == 64
        assert finished.usage.prompt_tokens == 70 and finished.usage.completion_tokens == 10
        timings = finished.timings
        # The prefill node's stages travel in the commit; the decode node adds its own.
        assert timings.prefill_queue_s == result.timings.prefill_queue_s >= 0
        assert timings.prefill_compute_s == result.timings.prefill_compute_s > 0
        assert timings.kv_transfer_s == result.timings.kv_transfer_s > 0
        assert timings.decode_queue_s >= 0
        assert 0 < timings.first_decode_step_s <= timings.decode_s
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body)


RECOMPUTE = decode_pb2.KV_FAILURE_POLICY_RECOMPUTE
FAIL = decode_pb2.KV_FAILURE_POLICY_FAIL


def open_stream(cluster: Cluster, request_id, prompt, *, lease_ms=5000, policy=RECOMPUTE):
    request = decode_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=GREEDY,
        kv_source="prefill",
        lease_ms=lease_ms,
        on_kv_failure=policy,
    )
    return cluster.decode.Generate(request, timeout=30)


async def read_events(stream) -> list:
    events = []
    while (event := await stream.read()) is not grpc.aio.EOF:
        events.append(event)
    return events


def test_recompute_streams_every_token_after_a_failed_handoff(tiny_llama_dir: Path) -> None:
    """Under on_kv_failure=RECOMPUTE a lease that expires and a commit whose pages never landed
    both end in the decode node computing the prompt itself: Recomputing, then tokens 1..N equal
    to the single engine's, counted by cause."""
    prompts = {"expired": list(range(10, 50)), "early": list(range(60, 130))}
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = offline.generate(list(prompts.values()), params)
    expected = {name: out.token_ids for name, out in zip(prompts, outputs, strict=True)}
    ports = tuple(free_ports(2))

    async def body(cluster: Cluster) -> None:
        expired = open_stream(cluster, "expired", prompts["expired"], lease_ms=200)
        early = open_stream(cluster, "early", prompts["early"])
        assert (await expired.read()).WhichOneof("event") == "reservation"
        reservation = (await early.read()).reservation
        with pytest.raises(grpc.aio.AioRpcError) as error:  # no page was pushed
            commit = kv_pb2.KvCommit(transfer_id=reservation.transfer_id, first_token_id=5)
            await cluster.decode.CommitKv(commit, timeout=5)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        for name, stream, reason in (
            ("expired", expired, "lease expired"),
            ("early", early, "committed before its pages landed"),
        ):
            events = await read_events(stream)
            kinds = [event.WhichOneof("event") for event in events]
            assert kinds[0] == "recomputing" and kinds[-1] == "finished"
            assert set(kinds[1:-1]) == {"tokens"}
            assert reason in events[0].recomputing.reason
            tokens = [t for event in events[1:-1] for t in event.tokens.token_ids]
            assert tokens == expected[name]  # token 1 included: it came from this node
            finished = events[-1].finished
            assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert finished.usage.completion_tokens == 10
            assert finished.timings.prefill_compute_s > 0 and finished.timings.kv_transfer_s == 0
        await cluster.wait_all_free()
        metrics = scrape(ports[1])
        for cause in ("lease_expired", "bad_commit"):
            assert re.search(
                rf'pdserve:kv_recomputes_total\{{[^}}]*cause="{cause}"[^}}]*\}} 1\.0', metrics
            ), cause

    run_cluster(tiny_llama_dir, body, metrics_ports=ports)


def test_the_callers_abort_and_the_fail_policy_are_never_recomputed(tiny_llama_dir) -> None:
    async def body(cluster: Cluster) -> None:
        aborted = open_stream(cluster, "aborted", list(range(10, 50)))
        failing = open_stream(cluster, "failing", list(range(60, 90)), lease_ms=200, policy=FAIL)
        assert (await aborted.read()).WhichOneof("event") == "reservation"
        assert (await failing.read()).WhichOneof("event") == "reservation"
        abort = decode_pb2.AbortRequest(request_id="aborted")
        assert (await cluster.decode.Abort(abort, timeout=5)).found
        for stream, detail in ((aborted, "aborted by the caller"), (failing, "lease expired")):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stream.read()
            assert error.value.code() == grpc.StatusCode.ABORTED
            assert detail in error.value.details()
        await cluster.wait_all_free()

    run_cluster(tiny_llama_dir, body)


# The prefill node's pushes hold their last message back this long: pages are moving meanwhile.
PUSH_PAUSE = ("--test-kv-push-pause-s", "1.0")


@pytest.mark.parametrize("cancel_prefill", [False, True], ids=["decode-leg", "both-legs"])
def test_cancelling_mid_transfer_frees_both_nodes(tiny_llama_dir, cancel_prefill) -> None:
    """The Generate stream (and, as a disconnecting gateway does, the Prefill call) is cancelled
    while the prefill node is pushing: the decode node fences and frees, the push ends without
    its commit, and both nodes end with no blocks in use and keep serving."""

    async def body(cluster: Cluster) -> None:
        prompt = list(range(10, 250))
        stream = open_stream(cluster, "moving", prompt, policy=RECOMPUTE)
        reservation = (await stream.read()).reservation
        prefill_call = cluster.prefill.Prefill(
            prefill_pb2.PrefillRequest(
                request_id="moving",
                prompt_token_ids=prompt,
                sampling=GREEDY,
                destination=reservation,
                decode_target=cluster.decode_address,
            ),
            timeout=30,
        )
        await asyncio.sleep(0.3)  # computed (milliseconds), now inside the paused push
        assert not prefill_call.done()
        assert (await cluster.blocks_in_use())[0] > 0  # the prefill node holds its pages
        stream.cancel()  # the caller's cancel: never recomputed
        if cancel_prefill:
            prefill_call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await prefill_call
        else:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await prefill_call
            # The fenced transfer refused the rest of the push.
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "KV push" in error.value.details()
        await cluster.wait_all_free()

    async def after(cluster: Cluster) -> None:
        await body(cluster)
        tokens, _ = await cluster.generate("after", [1, 2, 3])  # both nodes still serve
        assert len(tokens) == 10

    run_cluster(tiny_llama_dir, after, prefill_flags=PUSH_PAUSE)


def test_cancelling_mid_decode_frees_both_nodes(tiny_llama_dir: Path) -> None:
    """After the commit, a cancelled stream and an Abort both end the decode within a step."""
    sampling = common_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def one(cluster: Cluster, request_id: str, use_abort: bool) -> None:
        prompt = list(range(10, 40))
        stream = cluster.decode.Generate(
            decode_pb2.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                kv_source="prefill",
            ),
            timeout=30,
        )
        reservation = (await stream.read()).reservation
        await cluster.prefill.Prefill(
            prefill_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                destination=reservation,
                decode_target=cluster.decode_address,
            ),
            timeout=30,
        )
        for _ in range(3):
            assert (await stream.read()).WhichOneof("event") == "tokens"
        if use_abort:
            abort = decode_pb2.AbortRequest(request_id=request_id)
            assert (await cluster.decode.Abort(abort, timeout=5)).found
            events = await read_events(stream)
            assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_ABORT
            assert events[-1].finished.usage.completion_tokens < 200
        else:
            stream.cancel()
        await cluster.wait_all_free()

    async def body(cluster: Cluster) -> None:
        await one(cluster, "cancelled", use_abort=False)
        await one(cluster, "aborted", use_abort=True)

    run_cluster(tiny_llama_dir, body)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the transformers reference is slow on a loaded host (conftest)
def test_smollm2_gguf_through_both_nodes_equals_transformers(
    smollm2_gguf: Path, smollm2_reference
) -> None:
    """The real model from its GGUF, served disaggregated: 8 chat prompts x 32 greedy tokens equal
    transformers' own GGUF loader, the first token from prefill and the rest from decode."""
    prompts, expected = smollm2_reference
    sampling = common_pb2.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    async def body(cluster: Cluster) -> None:
        results = await asyncio.gather(
            *(cluster.generate(f"smol-{i}", p, sampling) for i, p in enumerate(prompts))
        )
        assert [tokens for tokens, _ in results] == expected
        await cluster.wait_all_free()

    # fp32 KV (as transformers keeps it) of SmolLM2 is 45 KiB a token: room for all 8 requests
    # (~70 tokens each) at once.
    run_cluster(
        smollm2_gguf.parent,
        body,
        kv_memory=("32MiB", "32MiB"),
        node_flags=("--kv-cache-dtype", "float32"),
    )
