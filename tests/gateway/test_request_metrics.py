"""The gateway's request metrics as a client's requests leave them: a real gateway (both APIs,
the routed generator, the key-metering wrapper, the gRPC legs) over fake nodes
(``support.fake_node``, no model). Each finished request is counted once in
``request_success``, whatever stopped it; each failed one once in ``request_errors``, under its
most specific reason, on either API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from gateway.config import parse_gateway_config
from gateway.server import GatewayServer
from gateway.text.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from support import fake_node
from support.raw_grpc import refused_raw_call

COUNTING = "Count: 1, 2, 3, 4, 5, 6, 7, 8"


@dataclass
class Stack:
    gateway: GatewayServer
    http: httpx.AsyncClient
    grpc: gateway_pb2_grpc.GatewayServiceStub

    def sample(self, name: str, **labels: str) -> float:
        value = self.gateway.metrics.registry.get_sample_value(f"pdserve:{name}", labels)
        return 0.0 if value is None else value

    def counted(self, counter: str, label: str) -> dict[str, float]:
        """``{label value: count}`` of one counter's series (``request_errors``, ...)."""
        return {
            sample.labels[label]: sample.value
            for metric in self.gateway.metrics.registry.collect()
            if metric.name == f"pdserve:{counter}"
            for sample in metric.samples
            if sample.name.endswith("_total")
        }

    async def generate(
        self, stop: tuple[str, ...] = (), max_tokens: int = 16
    ) -> tuple[grpc.StatusCode, list[gateway_pb2.GatewayGenerateResponse]]:
        request = gateway_pb2.GatewayGenerateRequest(
            text="Count:", sampling=common_pb2.SamplingParams(max_tokens=max_tokens), stop=stop
        )
        responses: list[gateway_pb2.GatewayGenerateResponse] = []
        try:
            async for response in self.grpc.Generate(request, timeout=20):
                responses.append(response)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), responses
        return grpc.StatusCode.OK, responses


Body = Callable[[Stack], Awaitable[None]]


async def _start_node(role: str, **script: Any) -> tuple[grpc.aio.Server, str]:
    return await fake_node.serve_in_process(
        fake_node.FakeNode(fake_node.in_process_args(role, **script))
    )


def serve(
    model_dir: Path, body: Body, flags: tuple[str, ...] = (), **roles: list[dict[str, Any]]
) -> None:
    """Runs ``body`` against a gateway over fake nodes: ``roles`` maps prefill, decode or
    colocated to one script (``fake_node`` flags) per node; ``flags``: more gateway flags."""

    async def main() -> None:
        servers, node_flags = [], list(flags)
        for role, scripts in roles.items():
            addresses = []
            for script in scripts:
                server, address = await _start_node(role, **script)
                servers.append(server)
                addresses.append(address)
            node_flags.append(f"--{role}={','.join(addresses)}")
        config = parse_gateway_config(
            ["--model", str(model_dir), "--host", "127.0.0.1", "--http-port", "0",
             "--grpc-port", "0", "--max-model-len", "512", "--health-interval-s", "60",
             *node_flags],
            {},
        )  # fmt: skip
        gateway = GatewayServer(config)
        await gateway.start()
        try:
            async with (
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.http_port}", timeout=20)
                as http,
                grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel,
            ):  # fmt: skip
                await body(Stack(gateway, http, gateway_pb2_grpc.GatewayServiceStub(channel)))
        finally:
            await gateway.stop(grace_s=0.5)
            for server in servers:
                await server.stop(0)

    asyncio.run(main())


def sse_chunks(body: str) -> list[dict[str, Any]]:
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


# --- finished requests ----------------------------------------------------------------------


def test_a_stop_string_is_a_finished_request(tiny_llama_dir: Path, tokenizer: Tokenizer) -> None:
    """The reproduction: ``"stop": ", "`` over an answer that goes on past it. The stop string
    ends the generation before the node's Finished; the request is counted finished (stop), with
    its latency and the stages the gateway knows, once per request on either API."""
    script = tokenizer.encode(COUNTING, add_special_tokens=False)

    async def body(stack: Stack) -> None:
        request = {"prompt": "Count:", "max_tokens": 16, "temperature": 0, "stop": ", "}
        response = await stack.http.post("/v1/completions", json=request)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ", ")

        response = await stack.http.post("/v1/completions", json={**request, "stream": True})
        assert sse_chunks(response.text)[-1]["choices"][0]["finish_reason"] == "stop"

        status, responses = await stack.generate(stop=(", ",))
        assert status == grpc.StatusCode.OK
        assert responses[-1].finished.finish_reason == common_pb2.FINISH_REASON_STOP
        assert responses[-1].finished.stop_reason == ", "

        assert stack.counted("request_success", "finished_reason") == {"stop": 3}
        assert stack.sample("e2e_request_latency_seconds_count") == 3
        assert stack.sample("request_stage_seconds_count", stage="gateway_queue") == 3
        assert stack.counted("request_errors", "reason") == {}

    serve(tiny_llama_dir, body, colocated=[{"script": script}])


def test_a_stop_string_completed_at_max_tokens_counts_as_the_client_is_told(
    tiny_llama_dir: Path, tokenizer: Tokenizer
) -> None:
    """``max_tokens`` ends the generation (the node says ``length``) on a token whose text was
    held back (a character's first byte); its flushed text (U+FFFD) completes the stop string.
    The client is told ``stop``, and the metric counts ``stop`` too, once per request."""
    lead_byte = next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == b"\xc3")
    stop = "\ufffd"  # what a character cut short decodes to

    async def body(stack: Stack) -> None:
        # The fake node answers prompt[-1], prompt[-1] + 1, ...: the one output token is lead_byte.
        request = {"prompt": [lead_byte], "max_tokens": 1, "stop": [stop]}
        response = await stack.http.post("/v1/completions", json=request)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
            "",
            "stop",
            stop,
        )

        response = await stack.http.post("/v1/completions", json={**request, "stream": True})
        assert sse_chunks(response.text)[-1]["choices"][0]["finish_reason"] == "stop"

        generate = gateway_pb2.GatewayGenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=[lead_byte]),
            sampling=common_pb2.SamplingParams(max_tokens=1),
            stop=[stop],
        )
        responses = [response async for response in stack.grpc.Generate(generate, timeout=20)]
        assert responses[-1].finished.finish_reason == common_pb2.FINISH_REASON_STOP

        assert stack.counted("request_success", "finished_reason") == {"stop": 3}
        assert stack.sample("e2e_request_latency_seconds_count") == 3
        assert stack.counted("request_errors", "reason") == {}

    serve(tiny_llama_dir, body, colocated=[{}])


def test_a_client_gone_is_no_finished_request(tiny_llama_dir: Path) -> None:
    """A client that leaves mid-stream: counted as such, never as a success."""

    async def body(stack: Stack) -> None:
        request = {"prompt": "Count:", "max_tokens": 50, "stream": True}
        async with stack.http.stream("POST", "/v1/completions", json=request) as response:
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: {")
        for _ in range(200):
            if stack.gateway.admission.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert stack.counted("request_errors", "reason") == {"client_disconnected": 1}
        assert stack.counted("request_success", "finished_reason") == {}
        assert stack.sample("e2e_request_latency_seconds_count") == 0

    serve(tiny_llama_dir, body, colocated=[{"itl_ms": 100}])


def test_tokens_count_once_per_generation(tiny_llama_dir: Path) -> None:
    """``prompt_tokens_total`` and ``generation_tokens_total`` (vLLM's counters of the same
    names) add each finished generation's usage once, whichever leg reported it: a request of
    ``n`` choices counts its prompt ``n`` times, as vLLM's engine does, where the response's
    usage counts it once (as OpenAI's does)."""

    async def body(stack: Stack) -> None:
        request = {"prompt": [5, 6, 7], "max_tokens": 4, "n": 2}
        response = await stack.http.post("/v1/completions", json=request)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 8)
        assert stack.sample("prompt_tokens_total") == 2 * 3
        assert stack.sample("generation_tokens_total") == 8

        status, responses = await stack.generate(max_tokens=5)
        assert status == grpc.StatusCode.OK
        finished = responses[-1].finished
        assert finished.usage.completion_tokens == 5
        assert stack.sample("prompt_tokens_total") == 6 + finished.usage.prompt_tokens
        assert stack.sample("generation_tokens_total") == 8 + 5

    serve(tiny_llama_dir, body, prefill=[{}], decode=[{}])


def test_metrics_carry_no_created_series(tiny_llama_dir: Path) -> None:
    """Counters and histograms are exported without their ``_created`` series, as vLLM's are:
    each doubles the series scraped and says nothing a restart's reset does not."""

    async def body(stack: Stack) -> None:
        response = await stack.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 200, response.text
        exported = (await stack.http.get("/metrics")).text
        assert "pdserve:request_success_total{" in exported
        assert "pdserve:e2e_request_latency_seconds_count" in exported
        assert "_created" not in exported

    serve(tiny_llama_dir, body, colocated=[{}])


# --- failed requests: once each, the most specific reason --------------------------------------


def test_no_healthy_node_counts_once_as_no_node(tiny_llama_dir: Path) -> None:
    async def body(stack: Stack) -> None:
        for node in stack.gateway.pool.nodes:
            node.mark_failed("test")
        response = await stack.http.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503
        status, _ = await stack.generate()
        assert status == grpc.StatusCode.UNAVAILABLE
        assert stack.counted("request_errors", "reason") == {"no_node": 2}

    serve(tiny_llama_dir, body, colocated=[{}])


def test_no_kv_capacity_counts_once_as_no_capacity(tiny_llama_dir: Path) -> None:
    async def body(stack: Stack) -> None:
        response = await stack.http.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 429
        status, _ = await stack.generate()
        assert status == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stack.counted("request_errors", "reason") == {"no_capacity": 2}

    serve(tiny_llama_dir, body, prefill=[{}], decode=[{"refuse": True}])


@pytest.mark.parametrize("api", ["http", "http_stream", "http_n2", "grpc"])
def test_a_stream_cut_off_counts_once_as_stream_error(tiny_llama_dir: Path, api: str) -> None:
    """The node fails after three tokens: the request fails once (per request, whatever its
    ``n``), as ``stream_error``; and its generations finished, with reason error."""

    async def body(stack: Stack) -> None:
        request: dict[str, Any] = {"prompt": "Count:", "max_tokens": 10}
        if api == "grpc":
            status, responses = await stack.generate(max_tokens=10)
            assert status == grpc.StatusCode.OK
            assert responses[-1].finished.finish_reason == common_pb2.FINISH_REASON_ERROR
        elif api == "http_stream":
            response = await stack.http.post("/v1/completions", json={**request, "stream": True})
            assert response.status_code == 200 and '"error"' in response.text
        else:
            n = 2 if api == "http_n2" else 1
            response = await stack.http.post("/v1/completions", json={**request, "n": n})
            assert response.status_code == 503
        assert stack.counted("request_errors", "reason") == {"stream_error": 1}
        num_generations = 2 if api == "http_n2" else 1
        assert stack.counted("request_success", "finished_reason") == {"error": num_generations}

    serve(tiny_llama_dir, body, colocated=[{"fail_after_tokens": 3, "itl_ms": 10}])


def test_a_malformed_grpc_request_counts_once_as_invalid_argument(tiny_llama_dir: Path) -> None:
    """Bytes that do not parse as the request are refused by the shared interceptor before any
    servicer runs; the gateway counts each such call to its API once, as an HTTP body that is
    not JSON is counted (``invalid_argument``). A health probe is no API request: not counted."""
    corrupt = b"\xff\xff\xff"
    calls = [  # (method, kind, payload): a corrupt wire format, and a text field not UTF-8
        ("/pdserve.v1.GatewayService/Generate", "unary_stream", corrupt),
        ("/pdserve.v1.GatewayService/Generate", "unary_stream", b"\x12\x03\xff\xfe\x41"),
        ("/pdserve.v1.GatewayService/ListModels", "unary_unary", corrupt),
        ("/grpc.health.v1.Health/Check", "unary_unary", corrupt),
    ]

    async def body(stack: Stack) -> None:
        address = f"127.0.0.1:{stack.gateway.grpc_port}"
        async with grpc.aio.insecure_channel(address) as channel:
            for method, kind, payload in calls:
                error = await refused_raw_call(channel, method, kind, payload)
                assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, method
        assert stack.counted("request_errors", "reason") == {"invalid_argument": 3}

    serve(tiny_llama_dir, body, colocated=[{}])


def test_an_unauthenticated_model_list_counts_once_on_either_api(tiny_llama_dir: Path) -> None:
    """Listing the models without the key is refused on both APIs, and counted on both."""

    async def body(stack: Stack) -> None:
        response = await stack.http.get("/v1/models")
        assert response.status_code == 401
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stack.grpc.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert stack.counted("request_errors", "reason") == {"unauthenticated": 2}

    serve(tiny_llama_dir, body, flags=("--api-key", "secret"), colocated=[{}])
