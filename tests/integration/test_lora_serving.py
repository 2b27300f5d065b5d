"""LoRA adapters through the whole stack: nodes started with ``--lora-modules`` and a gateway
that knows the names serve a request whose model is an adapter with that adapter (on the
prefill node and the decode node alike, or on a colocated node), and the base model beside it;
each equals the offline engine's output for the same adapter."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.v1 import common_pb2, decode_pb2_grpc, gateway_pb2
from services.engine import LLM, LoRARequest, SamplingParams
from support.inprocess_stack import GREEDY, MAX_MODEL_LEN, Stack, node_channel, run_stack
from support.lora_adapter import write_adapter


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora") / "sql"
    write_adapter(path, tiny_llama_dir, seed=5)
    return path


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, adapter: Path):
    """Prompts (one prefilled on the prefill node, one on the decode node) and the offline
    engine's greedy tokens for each, with the adapter and without."""
    rng = random.Random(8)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in (150, 12)]
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, enable_lora=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with_lora = llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, adapter))
    base = llm.generate(prompts, params)
    return prompts, [o.token_ids for o in with_lora], [o.token_ids for o in base]


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_a_request_naming_an_adapter_runs_it(
    tiny_llama_dir: Path, adapter: Path, expected, colocated: bool
) -> None:
    prompts, with_lora, base = expected
    assert with_lora != base  # the adapter changes the output

    async def body(stack: Stack) -> None:
        for prompt, lora_tokens, base_tokens in zip(prompts, with_lora, base, strict=True):
            got, _, _ = await stack.generate(prompt, GREEDY, model="sql")
            assert got == lora_tokens
            got, _, _ = await stack.generate(prompt, GREEDY)
            assert got == base_tokens
        # The client's own lora_name must be one of the gateway's adapters.
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(GREEDY)
        sampling.lora_name = "nope"
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stack.generate(prompts[1], sampling)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.lora_name" in (error.value.details() or "")
        models = await stack.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
        assert [(m.id, m.parent) for m in models.models][-1] == ("sql", "tiny-llama")
        base_url = f"http://127.0.0.1:{stack.gateway.http_port}"
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            body = {"model": "sql", "prompt": prompts[1], "max_tokens": 8, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "sql"
            cards = (await client.get("/v1/models")).json()["data"]
            assert {"id": "sql", "parent": "tiny-llama"}.items() <= cards[-1].items()
        # Each node reports the adapters it loaded: the router sends a request of one only there.
        name = next(n for n in stack.nodes if not n.startswith("prefill"))
        server, _ = stack.nodes[name]
        async with node_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            report = await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)
        assert list(report.lora_names) == ["sql"]
        await stack.wait_all_free()

    run_stack(
        tiny_llama_dir,
        body,
        colocated=colocated,
        extra=["--lora-modules", "sql", "--served-model-name", "tiny-llama"],
        node_extra=["--lora-modules", f"sql={adapter}"],
    )
