"""Several names for the served model (``--served-model-name a b``, vLLM's): both APIs list
them all, take a request naming any, and answer under the first; another name is 404 naming
them."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx

from gateway.text.tokenizer import Tokenizer
from pdserve.v1 import gateway_pb2
from support.fake_gateway import FakeGateway
from support.openai_app import MODEL, assert_error, start


def test_a_request_may_name_any_alias(tokenizer: Tokenizer) -> None:
    served, server = start(tokenizer, aliases=("gpt-4o-mini",))
    try:
        assert [model.id for model in served.client().models.list().data] == [MODEL, "gpt-4o-mini"]
        assert served.client().models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
        cards = httpx.get(f"{served.url}/v1/models").json()["data"]
        assert [card["root"] for card in cards] == [MODEL, MODEL]  # each name stands for the model
        body = {"model": "gpt-4o-mini", "prompt": "x", "max_tokens": 2}
        response = served.post("/v1/completions", body)
        assert response.status_code == 200 and response.json()["model"] == MODEL  # vLLM: the first
        error = assert_error(
            served.post("/v1/completions", {**body, "model": "other"}), 404, "model"
        )
        assert "gpt-4o-mini" in error["message"] and MODEL in error["message"]
    finally:
        server.stop()


def test_grpc_api_takes_every_served_name(tiny_llama_dir: Path) -> None:
    served = FakeGateway.start(tiny_llama_dir, extra=("--served-model-name", "tiny", "alias"))
    try:

        async def list_models() -> gateway_pb2.ListModelsResponse:  # on the gateway's loop
            return await served.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)

        listed = served.loop.run_until_complete(list_models())
        assert [card.id for card in listed.models] == ["tiny", "alias"]
        request = gateway_pb2.GatewayGenerateRequest(model="alias", text="hi")
        assert served.call(request)[0] is grpc.StatusCode.OK
        request.model = "other"
        code, details, _ = served.call(request)
        assert code is grpc.StatusCode.NOT_FOUND and "'alias'" in details
    finally:
        served.close()
