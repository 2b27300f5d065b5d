"""Per-key limits: the limiter on a fake clock, the key file, and the HTTP API's 429s.

Rates are driven by an injected clock (no test sleeps); the HTTP tests run the real app (auth,
limiter, admission, OpenAI bodies) over a scripted generator, in process.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from gateway.admission import Admission
from gateway.api_key_file import load_api_key_file
from gateway.auth import ApiKey, ApiKeys, KeyLimits
from gateway.embedding import Embedding, EmbeddingRequest
from gateway.errors import ErrorKind, GatewayError
from gateway.frontend import Frontend
from gateway.generation import Finished, GenerationEvent, GenerationRequest, TokenChunk
from gateway.http_api.openai_app import build_openai_app
from gateway.key_limiter import KeyLimiter, KeyMeteredGenerator
from gateway.limits import RequestLimits
from gateway.metrics import GatewayMetrics
from gateway.routing.node_census import NodeCensus, RoleCensus
from gateway.text.tokenizer import Tokenizer
from services.types import FinishReason, Usage

SECRET_A = "sk-alpha-7f3b1c9d2e"
SECRET_B = "sk-bravo-0a8e6d4c21"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_limiter(clock: FakeClock | None = None) -> tuple[KeyLimiter, GatewayMetrics]:
    metrics = GatewayMetrics()
    return KeyLimiter(metrics.registry, clock or FakeClock()), metrics


def key(name: str = "team-a", secret: str = SECRET_A, **limits: int) -> ApiKey:
    return ApiKey(name, secret, KeyLimits(**limits))


def refusal(limiter: KeyLimiter, api_key: ApiKey) -> GatewayError:
    with pytest.raises(GatewayError) as error:
        limiter.acquire(api_key)
    assert error.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    return error.value


# --- the limiter -------------------------------------------------------------------------------


def test_requests_per_minute_slide_with_the_clock_and_keys_are_independent() -> None:
    clock = FakeClock()
    limiter, metrics = make_limiter(clock)
    a, b = key(requests_per_minute=2), key("team-b", SECRET_B, requests_per_minute=2)
    limiter.acquire(a).release()
    clock.now += 10
    limiter.acquire(a).release()
    error = refusal(limiter, a)
    assert error.retry_after_s == 50  # the first request leaves the window 60 s after it came
    assert "requests_per_minute" in error.message and "team-a" in error.message
    limiter.acquire(b).release()  # another key is not affected
    clock.now += 50
    limiter.acquire(a).release()  # the first one expired
    refusal(limiter, a)
    registry = metrics.registry
    assert registry.get_sample_value("pdserve:api_key_requests_total", {"key_name": "team-a"}) == 3
    assert (
        registry.get_sample_value(
            "pdserve:api_key_rate_limited_total",
            {"key_name": "team-a", "limit": "requests_per_minute"},
        )
        == 2
    )


def test_tokens_per_minute_count_what_was_used_and_expire() -> None:
    clock = FakeClock()
    limiter, metrics = make_limiter(clock)
    a = key(tokens_per_minute=100)
    lease = limiter.acquire(a)
    lease.add_tokens(60)
    clock.now += 20
    lease.add_tokens(50)  # 110 >= 100: the next request must wait
    lease.release()
    error = refusal(limiter, a)
    # Dropping the first record (60 tokens, 40 s from expiring) brings the total under 100.
    assert error.retry_after_s == 40
    clock.now += 40
    limiter.acquire(a).release()
    assert metrics.registry.get_sample_value(
        "pdserve:api_key_tokens_total", {"key_name": "team-a"}
    ) == pytest.approx(110)


def test_max_concurrent_counts_requests_in_flight_until_released() -> None:
    limiter, metrics = make_limiter()
    a = key(max_concurrent=2)
    first, second = limiter.acquire(a), limiter.acquire(a)
    assert refusal(limiter, a).retry_after_s == 1
    gauge = metrics.registry.get_sample_value
    assert gauge("pdserve:api_key_requests_running", {"key_name": "team-a"}) == 2
    first.release()
    first.release()  # idempotent: one request is released once
    third = limiter.acquire(a)
    second.release()
    third.release()
    assert gauge("pdserve:api_key_requests_running", {"key_name": "team-a"}) == 0


def test_no_key_configured_is_never_limited() -> None:
    limiter, _ = make_limiter()
    assert limiter.acquire(None) is None


def test_the_metered_generator_charges_the_prompt_and_each_chunk() -> None:
    import asyncio

    async def inner(request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        yield TokenChunk((1, 2))
        yield TokenChunk((3,))
        yield Finished(FinishReason.LENGTH, Usage(4, 3))

    class Inner:
        def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
            return inner(request)

    limiter, _ = make_limiter()
    metered = KeyMeteredGenerator(Inner())

    async def main() -> int:
        with limiter.hold(key(tokens_per_minute=1000)) as lease:
            request = GenerationRequest("r", (5, 6, 7, 8), sampling=None)  # type: ignore[arg-type]
            events = [event async for event in metered.generate(request)]
            assert len(events) == 3
            assert lease is not None
            return lease.num_tokens

    assert asyncio.run(main()) == 4 + 3


# --- the key file ------------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return path


def test_a_key_file_gives_names_and_limits(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"keys:\n"
        f"  - {{name: team-a, key: {SECRET_A}, requests_per_minute: 60, max_concurrent: 2}}\n"
        f"  - {{name: team-b, key: {SECRET_B}, tokens_per_minute: 5000}}\n",
    )
    a, b = load_api_key_file(path)
    assert (a.name, a.limits) == ("team-a", KeyLimits(60, None, 2))
    assert (b.name, b.limits) == ("team-b", KeyLimits(None, 5000, None))
    assert SECRET_A not in repr(a)
    assert ApiKeys([a, b]).check(f"Bearer {SECRET_B}") is b


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"keys:\n  - {{name: a, key: {SECRET_A}, rpm: 3}}\n", "unknown field"),
        (f"keys:\n  - {{name: a, key: {SECRET_A}, max_concurrent: 0}}\n", "max_concurrent"),
        (f"keys:\n  - {{name: 'a b', key: {SECRET_A}}}\n", "name"),
        (
            f"keys:\n  - {{name: a, key: {SECRET_A}}}\n  - {{name: b, key: {SECRET_A}}}\n",
            "same key as entry 1",
        ),
        (f"keys:\n  - {{name: a, key: {SECRET_A}}}\n  - {{name: a, key: x}}\n", "name 'a'"),
        (f"keys: [{{name: a, key: '{SECRET_A}\n", "not valid YAML"),
        ("keys: []\n", "non-empty"),
    ],
)
def test_a_bad_key_file_names_the_entry_but_never_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ValueError) as error:
        load_api_key_file(write(tmp_path, text))
    assert message in str(error.value)
    assert SECRET_A not in str(error.value)


# --- over HTTP ---------------------------------------------------------------------------------


class ScriptedGenerator:
    """Every request: two token chunks and a Finished."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        yield TokenChunk((self.token_id,))
        yield TokenChunk((self.token_id,))
        yield Finished(FinishReason.LENGTH, Usage(len(request.prompt_token_ids), 2))


def test_a_key_over_its_rate_gets_429_while_others_do_not(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    clock = FakeClock()
    metrics = GatewayMetrics()
    keys = ApiKeys(
        [
            key("team-a", SECRET_A, requests_per_minute=2),
            key("team-b", SECRET_B, requests_per_minute=100),
            "legacy-key-123",  # --api-key: named key-1, unlimited
        ]
    )
    frontend = Frontend(
        served_model_name="tiny",
        tokenizer=tokenizer,
        generator=KeyMeteredGenerator(ScriptedGenerator(tokenizer.encode("hi")[-1])),
        admission=Admission(8, 8),
        api_keys=keys,
        limits=RequestLimits(max_model_len=256, max_tokens=100),
        metrics=metrics,
        node_census=lambda: NodeCensus(colocated=RoleCensus(1, 1)),
        key_limiter=KeyLimiter(metrics.registry, clock),
    )
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}

    def post(secret: str, path: str = "/v1/completions"):
        return client.post(path, json=body, headers={"Authorization": f"Bearer {secret}"})

    with TestClient(build_openai_app(frontend)) as client:
        assert post(SECRET_A).status_code == 200
        clock.now += 30
        assert post(SECRET_A).status_code == 200
        refused = post(SECRET_A)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "30"
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "rate_limit_error" and error["code"] == 429
        assert "team-a" in error["message"] and "requests_per_minute" in error["message"]
        # Another key, a legacy --api-key key and the free routes are not affected.
        assert post(SECRET_B).status_code == 200
        assert post("legacy-key-123").status_code == 200
        models = client.get("/v1/models", headers={"Authorization": f"Bearer {SECRET_A}"})
        assert models.status_code == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        refused_chat = client.post(
            "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {SECRET_A}"}
        )
        assert refused_chat.status_code == 429
        responses = {"model": "tiny", "input": "hi"}
        refused_responses = client.post(
            "/v1/responses", json=responses, headers={"Authorization": f"Bearer {SECRET_A}"}
        )
        assert refused_responses.status_code == 429
        clock.now += 30  # the first request leaves the window
        assert post(SECRET_A).status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 401
        exported = client.get("/metrics").text

    assert 'pdserve:api_key_requests_total{key_name="team-a"} 3.0' in exported
    assert 'key_name="team-a",limit="requests_per_minute"} 3.0' in exported
    assert 'pdserve:api_key_requests_total{key_name="key-1"} 1.0' in exported
    # Tokens charged: each request's prompt plus its two generated tokens.
    prompt_len = len(tokenizer.encode("Hello"))
    tokens = metrics.registry.get_sample_value(
        "pdserve:api_key_tokens_total", {"key_name": "team-b"}
    )
    assert tokens == prompt_len + 2
    for secret in (SECRET_A, SECRET_B, "legacy-key-123"):
        assert secret not in exported
        assert secret not in caplog.text
    assert secret not in generate_latest(metrics.registry).decode()


class FixedEmbedder:
    """Answers each input with a vector made from its length."""

    async def embed(self, request: EmbeddingRequest) -> Embedding:
        return Embedding([float(len(request.prompt_token_ids)), 0.0])


def test_embedding_requests_count_against_the_key(tokenizer: Tokenizer) -> None:
    metrics = GatewayMetrics()
    frontend = Frontend(
        served_model_name="tiny",
        tokenizer=tokenizer,
        generator=KeyMeteredGenerator(ScriptedGenerator(tokenizer.encode("hi")[-1])),
        admission=Admission(8, 8),
        api_keys=ApiKeys([key("team-a", SECRET_A, requests_per_minute=1)]),
        limits=RequestLimits(max_model_len=256, max_tokens=100),
        metrics=metrics,
        node_census=lambda: NodeCensus(colocated=RoleCensus(1, 1)),
        key_limiter=KeyLimiter(metrics.registry, FakeClock()),
        embedder=FixedEmbedder(),
    )
    headers = {"Authorization": f"Bearer {SECRET_A}"}
    body = {"input": [[1, 2, 3], [4, 5]]}
    with TestClient(build_openai_app(frontend)) as client:
        reply = client.post("/v1/embeddings", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        assert [d["embedding"] for d in reply.json()["data"]] == [[3.0, 0.0], [2.0, 0.0]]
        assert client.post("/v1/embeddings", json=body, headers=headers).status_code == 429
    charged = metrics.registry.get_sample_value(
        "pdserve:api_key_tokens_total", {"key_name": "team-a"}
    )
    assert charged == 5
