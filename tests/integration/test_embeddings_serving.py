"""``/v1/embeddings`` through the whole stack: inputs as text or token ids, one or a batch,
embedded on the prefill node (disaggregated) or the colocated node, equal to the offline
engine's ``LLM.embed``; base64 as OpenAI's SDK asks for it; refusals naming the field."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch

from pdserve.v1 import gateway_pb2
from services.engine import LLM, PoolingParams
from support.inprocess_stack import MAX_MODEL_LEN, Stack, run_stack

TEXTS = ["The capital of France is", "Embeddings map text to vectors."]
IDS = [[5, 17, 300, 42, 9], list(range(20, 60))]


@pytest.fixture(scope="module")
def expected(matryoshka_llama_dir: Path) -> dict[str, list[list[float]]]:
    llm = LLM(matryoshka_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    return {
        "texts": [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)],
        "ids": [o.outputs.embedding for o in llm.embed(IDS, use_tqdm=False)],
        "short": [
            o.outputs.embedding
            for o in llm.embed(IDS[:1], PoolingParams(dimensions=8), use_tqdm=False)
        ],
    }


def assert_param(response: httpx.Response, status: int, param: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param, response.text


def close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_embeddings_equal_the_offline_engines(
    matryoshka_llama_dir: Path, expected, colocated: bool
) -> None:
    """On the tiny llama declaring is_matryoshka, so that ``dimensions`` may shorten them."""

    async def body(stack: Stack) -> None:
        base_url = f"http://127.0.0.1:{stack.gateway.http_port}"
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            response = await client.post("/v1/embeddings", json={"input": TEXTS})
            assert response.status_code == 200, response.text
            reply = response.json()
            assert reply["object"] == "list" and reply["model"] == "tiny-llama"
            assert [d["index"] for d in reply["data"]] == [0, 1]
            for data, want in zip(reply["data"], expected["texts"], strict=True):
                assert data["object"] == "embedding"
                close(data["embedding"], want)
            assert reply["usage"]["prompt_tokens"] == reply["usage"]["total_tokens"] > 0
            response = await client.post("/v1/embeddings", json={"input": IDS})
            for data, want in zip(response.json()["data"], expected["ids"], strict=True):
                close(data["embedding"], want)
            assert response.json()["usage"]["prompt_tokens"] == sum(map(len, IDS))
            one = await client.post("/v1/embeddings", json={
                "input": IDS[0], "dimensions": 8, "encoding_format": "base64"})  # fmt: skip
            packed = base64.b64decode(one.json()["data"][0]["embedding"])
            close(list(struct.unpack("<8f", packed)), expected["short"][0])

            for bad, param in (
                ({"input": []}, "input"),
                ({"input": [1] * (MAX_MODEL_LEN + 1)}, "input"),
                ({"input": [10**7]}, "input"),
                ({"input": "x", "dimensions": 10**6}, "dimensions"),
                ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
            ):
                response = await client.post("/v1/embeddings", json=bad)
                assert response.status_code == 400, (bad, response.text)
                assert response.json()["error"]["param"] == param, (bad, response.text)
            response = await client.post("/v1/embeddings", json={"model": "x", "input": "y"})
            assert response.status_code == 404
            kept = await client.post("/v1/embeddings", json={
                "input": [1] * (MAX_MODEL_LEN + 5), "truncate_prompt_tokens": -1})  # fmt: skip
            assert kept.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN

            # vLLM's score and rerank for an embedding model: cosine similarities.
            similar = [float(torch.dot(torch.tensor(expected["texts"][0]), torch.tensor(v)))
                    for v in expected["texts"]]  # fmt: skip
            scored = await client.post("/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS})
            assert scored.status_code == 200, scored.text
            got = [d["score"] for d in scored.json()["data"]]
            close(got, similar)
            assert got[0] == pytest.approx(1.0, abs=1e-5)  # a text against itself
            pairs = await client.post("/score", json={"text_1": TEXTS, "text_2": TEXTS[::-1]})
            close([d["score"] for d in pairs.json()["data"]], [similar[1], similar[1]])
            reranked = await client.post(
                "/v2/rerank", json={"query": TEXTS[0], "documents": TEXTS[::-1], "top_n": 1}
            )
            (best,) = reranked.json()["results"]
            assert (best["index"], best["document"]["text"]) == (1, TEXTS[0])
            close([best["relevance_score"]], [similar[0]])
            mismatched = await client.post(
                "/v1/score", json={"text_1": TEXTS, "text_2": [*TEXTS, "x"]}
            )
            assert_param(mismatched, 400, "text_1")
            too_long = await client.post(
                "/rerank", json={"query": "q", "documents": ["a " * (MAX_MODEL_LEN + 10)]}
            )
            assert_param(too_long, 400, "documents")

        # The public gRPC API's Embed: the same vectors.
        reply = await stack.stub.Embed(gateway_pb2.GatewayEmbedRequest(texts=TEXTS), timeout=60)
        for vector, want in zip(reply.embeddings, expected["texts"], strict=True):
            close(list(vector.values), want)
        assert reply.model == "tiny-llama" and reply.prompt_tokens > 0
        ids = [gateway_pb2.TokenIds(ids=IDS[0])]
        reply = await stack.stub.Embed(
            gateway_pb2.GatewayEmbedRequest(token_ids=ids, dimensions=8), timeout=60
        )
        close(list(reply.embeddings[0].values), expected["short"][0])
        for bad, code in (
            (gateway_pb2.GatewayEmbedRequest(), grpc.StatusCode.INVALID_ARGUMENT),
            (
                gateway_pb2.GatewayEmbedRequest(texts=["a"], token_ids=ids),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            (gateway_pb2.GatewayEmbedRequest(texts=["a"], model="x"), grpc.StatusCode.NOT_FOUND),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stack.stub.Embed(bad, timeout=60)
            assert error.value.code() == code, bad

        sdk = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none")
        result = await sdk.embeddings.create(model="tiny-llama", input=TEXTS[0])  # base64
        close(result.data[0].embedding, expected["texts"][0])
        await sdk.close()
        await stack.wait_all_free()

    run_stack(
        matryoshka_llama_dir,
        body,
        colocated=colocated,
        extra=["--served-model-name", "tiny-llama"],
    )
