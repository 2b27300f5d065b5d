"""``/v1/embeddings`` at the HTTP layer, over a scripted embedder: batches in input order, the
base64 encoding, the input bound, and a client that hangs up cancelling every input's work.
Against real nodes: ``tests/integration/test_embeddings_serving.py``."""

from __future__ import annotations

import asyncio
import base64
import struct
import threading

import httpx
import pytest

from gateway.embedding import Embedding, EmbeddingRequest
from gateway.embeddings import MAX_INPUTS
from gateway.text.tokenizer import Tokenizer
from support.openai_app import SETTLE_S, assert_error, start, wait_until


class ScriptedEmbedder:
    """Each input's vector is [its length, its first token]; ``hang`` never answers."""

    def __init__(self, hang: bool = False) -> None:
        self.hang = hang
        self.cancelled = threading.Event()

    async def embed(self, request: EmbeddingRequest) -> Embedding:
        if self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        ids = request.prompt_token_ids
        return Embedding([float(len(ids)), float(ids[0])])


@pytest.fixture
def served(tokenizer: Tokenizer):
    servers = []

    def make(embedder: ScriptedEmbedder | None):
        served, server = start(tokenizer, embedder=embedder)
        servers.append(server)
        return served

    yield make
    for server in servers:
        server.stop()


def test_a_batch_comes_back_in_input_order(served) -> None:
    url = served(ScriptedEmbedder()).url
    body = {"input": [[7, 8, 9], [5], [3, 4]], "encoding_format": "base64"}
    reply = httpx.post(f"{url}/v1/embeddings", json=body, timeout=30).json()
    vectors = [struct.unpack("<2f", base64.b64decode(d["embedding"])) for d in reply["data"]]
    assert vectors == [(3.0, 7.0), (1.0, 5.0), (2.0, 3.0)]
    assert [d["index"] for d in reply["data"]] == [0, 1, 2]
    assert reply["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    too_many = {"input": [[1]] * (MAX_INPUTS + 1)}
    assert_error(httpx.post(f"{url}/v1/embeddings", json=too_many, timeout=30), 400, "input")


def test_without_an_embedder_the_route_is_404(served) -> None:
    url = served(None).url
    response = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert response.status_code == 404


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": ["a", "b"]}),
        ("/v1/rerank", {"query": "a", "documents": ["b", "c"]}),
        ("/score", {"text_1": "a", "text_2": ["b"]}),
    ],
)
def test_a_client_that_hangs_up_cancels_the_work(served, path: str, body: dict) -> None:
    embedder = ScriptedEmbedder(hang=True)
    app = served(embedder)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{app.url}{path}", json=body, timeout=0.5)
    assert embedder.cancelled.wait(SETTLE_S), "the disconnect must cancel the node calls"
    wait_until(lambda: app.frontend.admission.num_running == 0)


def test_score_and_rerank_take_the_key_outside_v1_too(tokenizer: Tokenizer) -> None:
    served, server = start(tokenizer, api_keys=("sk-1",), embedder=ScriptedEmbedder())
    try:
        rerank = {"query": "a", "documents": ["b", "c c c"]}
        for path in ("/rerank", "/v2/rerank", "/score", "/v1/score"):
            body = rerank if "rerank" in path else {"text_1": "a", "text_2": ["b"]}
            assert httpx.post(f"{served.url}{path}", json=body, timeout=30).status_code == 401
            keyed = httpx.post(f"{served.url}{path}", json=body, timeout=30,
                               headers={"Authorization": "Bearer sk-1"})  # fmt: skip
            assert keyed.status_code == 200, (path, keyed.text)
    finally:
        server.stop()
