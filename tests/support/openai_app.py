"""The OpenAI bridge served by a real uvicorn over a scripted fake generator: the scaffolding
of the gateway's HTTP tests (``tests/gateway/test_openai_app.py``, ``test_tool_calls.py``)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn

from gateway.admission import Admission
from gateway.auth import ApiKeys
from gateway.embedding import Embedder
from gateway.frontend import Frontend
from gateway.generation import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    StopGeneration,
    TokenChunk,
)
from gateway.http_api.openai_app import build_openai_app
from gateway.limits import RequestLimits
from gateway.metrics import GatewayMetrics
from gateway.reasoning import ReasoningParser
from gateway.routing.node_census import NodeCensus, RoleCensus
from gateway.sampling_defaults import SamplingDefaults
from gateway.text.tokenizer import Tokenizer
from services.types import FinishReason, TokenLogprob, Usage

MODEL = "tiny-llama"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
OUTPUT_TEXT = "Hello world, this is a test of the gateway; it streams tokens back one at a time."
HANG = "hang"  # a script step: wait until cancelled
# What the gateway's node pool reports: one pair that serves, and one that does not yet.
ONE_PAIR = NodeCensus(prefill=RoleCensus(1, 1), decode=RoleCensus(1, 1))
NO_HEALTHY_PAIR = NodeCensus(prefill=RoleCensus(0, 1), decode=RoleCensus(1, 1))


# --- the fake generator -----------------------------------------------------------------------

Step = TokenChunk | Finished | Exception | float | str
Script = Callable[[GenerationRequest], list[Step]]


class FakeGenerator:
    """Plays a script per request: chunks and a Finished, an exception to raise, a float to
    sleep, or HANG; records each request and whether its iterator was closed before its end."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[GenerationRequest] = []
        self.closed_ids: list[str] = []
        self.closed = threading.Event()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.requests.append(request)
        steps = self.script(request)
        try:
            for step in steps:
                if isinstance(step, Exception):
                    raise step
                if isinstance(step, float):
                    await asyncio.sleep(step)
                elif step == HANG:
                    await asyncio.Event().wait()
                else:
                    yield step  # type: ignore[misc]
        except (GeneratorExit, asyncio.CancelledError, StopGeneration):  # stopped: as closed
            if isinstance(steps[-1], Finished) and step is steps[-1]:
                raise  # closed after its Finished: a normal end, not a cancellation
            self.closed_ids.append(request.request_id)
            self.closed.set()
            raise


def output_script(tokenizer: Tokenizer, text: str = OUTPUT_TEXT) -> Script:
    """One token per chunk of ``text``, cut at max_tokens; logprobs when asked for."""
    output_ids = tokenizer.encode(text, add_special_tokens=False)

    def script(request: GenerationRequest) -> list[Step]:
        ids = output_ids[: request.sampling.max_tokens]
        steps: list[Step] = []
        for token_id in ids:
            logprobs = None
            if request.sampling.logprobs is not None:
                top = ((token_id, -0.25), (token_id + 1, -1.5), (token_id + 2, float("-inf")))
                top = top[: request.sampling.logprobs]
                logprobs = (TokenLogprob(token_id, -0.25, top),)
            steps.append(TokenChunk((token_id,), logprobs))
        reason = FinishReason.LENGTH if len(ids) < len(output_ids) else FinishReason.STOP
        steps.append(Finished(reason, Usage(len(request.prompt_token_ids), len(ids), 3)))
        return steps

    return script


# --- serving --------------------------------------------------------------------------------


@dataclass
class Served:
    url: str
    frontend: Frontend
    generator: FakeGenerator
    tokenizer: Tokenizer

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=10)

    def post(self, path: str, body: object, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=10, **kwargs)


class ThreadedUvicorn:
    def __init__(self, app: object, send_buffer_bytes: int | None = None) -> None:
        sock = socket.socket()
        if send_buffer_bytes is not None:  # accepted connections inherit it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start(
    tokenizer: Tokenizer,
    script: Script | None = None,
    api_keys: tuple[str, ...] = (),
    max_concurrent: int = 8,
    max_queued: int = 8,
    nodes: NodeCensus = ONE_PAIR,
    client_send_timeout_s: float | None = 30.0,
    send_buffer_bytes: int | None = None,
    reasoning_parser: ReasoningParser | None = None,
    sampling_defaults: SamplingDefaults | None = None,
    aliases: tuple[str, ...] = (),
    tokenizer_admission: Admission | None = None,
    embedder: Embedder | None = None,
    tool_call_parser: str | None = None,
    responses_store_size: int = 1024,
    **limits: Any,
) -> tuple[Served, ThreadedUvicorn]:
    generator = FakeGenerator(script or output_script(tokenizer))
    frontend = Frontend(
        served_model_name=MODEL,
        tokenizer=tokenizer,
        generator=generator,
        admission=Admission(max_concurrent, max_queued),
        api_keys=ApiKeys(api_keys),
        limits=RequestLimits(**{"max_model_len": 256, "max_tokens": 100, **limits}),
        metrics=GatewayMetrics(),
        node_census=lambda: nodes,
        request_timeout_s=30.0,
        client_send_timeout_s=client_send_timeout_s,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
        sampling_defaults=sampling_defaults or SamplingDefaults(),
        served_model_aliases=aliases,
        embedder=embedder,
        responses_store_size=responses_store_size,
        **({} if tokenizer_admission is None else {"tokenizer_admission": tokenizer_admission}),
    )
    server = ThreadedUvicorn(build_openai_app(frontend), send_buffer_bytes)
    return Served(f"http://127.0.0.1:{server.port}", frontend, generator, tokenizer), server


def sse_lines(response: httpx.Response) -> list[str]:
    """The raw body split on blank lines; asserts the exact framing of each event."""
    body = response.text
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event.removeprefix("data: ") for event in events]


def sse_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    lines = sse_lines(response)
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    return error


# The bound on a wait for something that must happen: it returns as soon as it does, so a wide
# bound costs a passing run nothing and keeps a loaded 2-core CI host from failing it.
SETTLE_S = 30.0


def wait_until(predicate: Callable[[], bool], timeout: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
