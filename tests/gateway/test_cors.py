"""Cross-origin access to the HTTP API (``--allowed-origins`` and the like, vLLM's defaults) and
vLLM's ``/ping``: a browser's preflight is answered before any API key is asked for, and every
response, refusals included, carries the headers a browser needs to read it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from gateway.admission import Admission
from gateway.auth import ApiKeys
from gateway.config import CorsConfig
from gateway.frontend import Frontend
from gateway.http_api.openai_app import build_openai_app
from gateway.limits import RequestLimits
from gateway.metrics import GatewayMetrics
from gateway.routing.node_census import NodeCensus
from gateway.text.tokenizer import Tokenizer
from support.openai_app import MODEL, NO_HEALTHY_PAIR, ONE_PAIR, FakeGenerator, output_script

KEY = "sesame"
PAGE = "https://app.example"
PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def make_client(
    tokenizer: Tokenizer, cors: CorsConfig | None = None, nodes: NodeCensus = ONE_PAIR
) -> TestClient:
    frontend = Frontend(
        served_model_name=MODEL,
        tokenizer=tokenizer,
        generator=FakeGenerator(output_script(tokenizer)),
        admission=Admission(4, 4),
        api_keys=ApiKeys((KEY,)),
        limits=RequestLimits(max_model_len=256, max_tokens=100),
        metrics=GatewayMetrics(),
        node_census=lambda: nodes,
    )
    return TestClient(build_openai_app(frontend, cors))


@pytest.fixture
def client(tokenizer: Tokenizer) -> Iterator[TestClient]:
    with make_client(tokenizer) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_a_preflight_needs_no_api_key(client: TestClient, path: str) -> None:
    response = client.options(path, headers=PREFLIGHT)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "*"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert response.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in response.headers


def test_responses_and_refusals_carry_the_cors_headers(client: TestClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answered = client.post(
        "/v1/chat/completions",
        json=body,
        headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"},
    )
    assert answered.status_code == 200, answered.text
    assert answered.headers["access-control-allow-origin"] == "*"
    # HttpGate's 401 too: a page can read why it was refused.
    refused = client.post("/v1/chat/completions", json=body, headers={"Origin": PAGE})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "*"
    # Not a preflight (no Access-Control-Request-Method): the key is still asked for.
    assert client.options("/v1/chat/completions", headers={"Origin": PAGE}).status_code == 401


def test_only_the_allowed_origins_and_methods_pass(tokenizer: Tokenizer) -> None:
    cors = CorsConfig(
        allowed_origins=(PAGE,),
        allowed_methods=("GET", "POST"),
        allowed_headers=("Authorization", "Content-Type"),
        allow_credentials=True,
    )
    with make_client(tokenizer, cors) as client:
        allowed = client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert allowed.status_code == 200, allowed.text
        assert allowed.headers["access-control-allow-origin"] == PAGE
        assert allowed.headers["access-control-allow-credentials"] == "true"
        other = client.options(
            "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"}
        )
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
        delete = client.options(
            "/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"}
        )
        assert delete.status_code == 400
        elsewhere = {"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"}
        models = client.get("/v1/models", headers=elsewhere)
        assert models.status_code == 200  # CORS binds browsers only; the server still answers
        assert "access-control-allow-origin" not in models.headers


def test_ping_answers_as_health_does(tokenizer: Tokenizer) -> None:
    with make_client(tokenizer) as client:
        health = client.get("/health")
        for method in ("GET", "POST"):
            ping = client.request(method, "/ping")  # no key, as /health
            assert ping.status_code == 200, ping.text
            assert ping.json() == health.json()
        assert set(client.get("/openapi.json").json()["paths"]["/ping"]) == {"get", "post"}
    with make_client(tokenizer, nodes=NO_HEALTHY_PAIR) as client:
        assert client.get("/health").status_code == 503
        assert client.get("/ping").status_code == 503
        assert client.post("/ping").json()["error"]["type"] == "service_unavailable"
