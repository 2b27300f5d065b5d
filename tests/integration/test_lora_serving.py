"""LoRA adapters through the whole stack: nodes started with ``--lora-modules`` and a gateway
that knows the names serve a request whose model is an adapter with that adapter (on the
prefill node and the decode node alike, or on a colocated node), and the base model beside it;
each equals the offline engine's output for the same adapter."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import grpc
import httpx
import pytest
import torch

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


@pytest.fixture(scope="module")
def lora_embedding(tiny_llama_dir: Path, adapter: Path, expected) -> list[float]:
    """The offline engine's embedding of the first prompt with the adapter."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, enable_lora=True)
    (out,) = llm.embed(
        [expected[0][0]], lora_request=LoRARequest("sql", 1, adapter), use_tqdm=False
    )
    return out.outputs.embedding


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_a_request_naming_an_adapter_runs_it(
    tiny_llama_dir: Path, adapter: Path, expected, lora_embedding, colocated: bool
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
            # An embedding naming the adapter runs with it too.
            embedded = await client.post(
                "/v1/embeddings", json={"model": "sql", "input": prompts[0]}
            )
            assert embedded.json()["model"] == "sql"
            torch.testing.assert_close(
                torch.tensor(embedded.json()["data"][0]["embedding"]),
                torch.tensor(lora_embedding),
                atol=1e-5,
                rtol=1e-4,
            )
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


def test_adapters_load_and_unload_while_serving(
    tiny_llama_dir: Path, adapter: Path, expected, tmp_path: Path
) -> None:
    """vLLM's run-time updates (``--allow-runtime-lora-updating``) on a disaggregated stack of
    nodes started with ``--enable-lora`` and no adapter: a load is served at once on the prefill
    and the decode nodes, equal to the offline engine; a load one node cannot take is undone on
    the others; an unload lets the request running with the adapter finish with it, and the
    model is gone for new ones."""
    prompts, with_lora, base = expected

    async def node_adapters(stack: Stack) -> dict[str, list[str]]:
        return {
            name: await engine.call(lambda core: sorted(core.runner.lora.adapters))
            for name, (_, engine) in stack.nodes.items()
        }

    async def body(stack: Stack) -> None:
        base_url = f"http://127.0.0.1:{stack.gateway.http_port}"
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

            async def complete(model: str) -> httpx.Response:
                return await client.post("/v1/completions", json={
                    "model": model, "prompt": prompts[1], "max_tokens": 8, "temperature": 0.0,
                    "ignore_eos": True})  # fmt: skip

            assert (await complete("sql")).status_code == 404
            load = {"lora_name": "sql", "lora_path": str(adapter)}
            response = await client.post("/v1/load_lora_adapter", json=load)
            assert response.status_code == 200, response.text
            assert response.text == "Success: LoRA adapter 'sql' added successfully."
            for prompt, tokens in zip(prompts, with_lora, strict=True):  # at once, no poll
                got, _, _ = await stack.generate(prompt, GREEDY, model="sql")
                assert got == tokens
            assert (await complete("sql")).json()["model"] == "sql"
            cards = (await client.get("/v1/models")).json()["data"]
            assert [(c["id"], c["parent"]) for c in cards] == [
                ("tiny-llama", None), ("sql", "tiny-llama")]  # fmt: skip

            response = await client.post("/v1/load_lora_adapter", json=load)
            assert response.status_code == 400
            assert "has already been loaded" in response.json()["error"]["message"]
            for path in (str(tmp_path / "none"), "~no-such-user-here/sql"):
                missing = {"lora_name": "nope", "lora_path": path}
                response = await client.post("/v1/load_lora_adapter", json=missing)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == "lora_path"
            # The prefill node has room for a second adapter, the decode nodes do not: the
            # prefill node's load is undone.
            second = {"lora_name": "sql2", "lora_path": str(adapter)}
            response = await client.post("/v1/load_lora_adapter", json=second)
            assert response.status_code == 400, response.text
            assert "max_loras" in response.json()["error"]["message"]
            assert await node_adapters(stack) == {n: ["sql"] for n in stack.nodes}
            for bad in ({"lora_name": " ", "lora_path": "x"}, {"lora_name": "tiny-llama",
                        "lora_path": "x"}, {"lora_name": "a", "lora_path": "x",
                        "load_inplace": True}, {"lora_name": "a"}):  # fmt: skip
                response = await client.post("/v1/load_lora_adapter", json=bad)
                assert response.status_code == 400, (bad, response.text)

            # An unload while a request streams with the adapter: it ends with the adapter's
            # tokens (steps slowed to 50 ms, so it is still running).
            stream = {"model": "sql", "prompt": prompts[0], "max_tokens": 8, "temperature": 0.0,
                      "ignore_eos": True, "stream": True, "logprobs": 0,
                      "return_tokens_as_token_ids": True}  # fmt: skip
            async with client.stream("POST", "/v1/completions", json=stream) as streamed:
                lines = streamed.aiter_lines()
                chunks = [await anext(lines)]
                response = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
                assert response.status_code == 200, response.text
                assert response.text == "Success: LoRA adapter 'sql' removed successfully."
                assert (await complete("sql")).status_code == 404  # new requests: gone at once
                chunks += [line async for line in lines]
            events = [json.loads(c[6:])["choices"][0] for c in chunks if c.startswith("data: {")]
            tokens = [t for e in events if e["logprobs"] for t in e["logprobs"]["tokens"]]
            assert [int(t.removeprefix("token_id:")) for t in tokens] == with_lora[0]
            response = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert response.status_code == 404
            assert "sql" not in [c["id"] for c in (await client.get("/v1/models")).json()["data"]]
        await stack.wait_all_free()
        held = await node_adapters(stack)
        assert held["decode0"] == held["decode1"] == []
        # The prefill node keeps it for the reservation lease (requests reserved before the
        # unload may still reach it), but lists it no more: nothing new is routed with it.
        assert all("sql" not in engine.stats.lora_names for _, engine in stack.nodes.values())

    run_stack(
        tiny_llama_dir,
        body,
        extra=["--allow-runtime-lora-updating", "--served-model-name", "tiny-llama"],
        prefill_extra=["--max-loras", "2"],
        node_extra=["--enable-lora", "--test-step-delay-s", "0.05"],
    )


def test_a_node_back_gets_the_adapters_loaded_at_run_time(
    tiny_llama_dir: Path, adapter: Path, expected
) -> None:
    """A decode node that comes back from UNHEALTHY without an adapter loaded at run time (as a
    restarted node has only its ``--lora-modules``) gets it from the gateway at its first good
    poll, and requests of it are served equal to the offline engine. The loads and unloads go
    through the gRPC API's LoadLoraAdapter and UnloadLoraAdapter."""
    prompts, with_lora, _ = expected

    async def body(stack: Stack) -> None:
        # Through the gRPC API's LoadLoraAdapter (the HTTP one's test is above).
        for bad, field in ((" ", "lora_name"), ("tiny-llama", "lora_name")):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stack.stub.LoadLoraAdapter(
                    gateway_pb2.GatewayLoadLoraAdapterRequest(lora_name=bad, lora_path="x"),
                    timeout=30,
                )
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert field in (error.value.details() or "")
        load = gateway_pb2.GatewayLoadLoraAdapterRequest(lora_name="sql", lora_path=str(adapter))
        answer = await stack.stub.LoadLoraAdapter(load, timeout=120)
        assert answer.message == "Success: LoRA adapter 'sql' added successfully."
        server, engine = stack.nodes["decode1"]
        (node,) = [n for n in stack.gateway.pool.decode if n.address.endswith(f":{server.port}")]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30  # bounds a slow host, not the test

        async def until(done, what: str) -> None:
            while not await done():
                assert loop.time() < deadline, what
                await asyncio.sleep(0.05)

        assert await engine.call(lambda core: core.remove_lora("sql"))

        async def reported_gone() -> bool:
            return "sql" not in (node.load.lora_names or ())

        # A poll sent before the removal must not be the one that finds it back.
        await until(reported_gone, "no poll reported the removal")
        node.mark_failed("restarted (test)")

        async def restored() -> bool:
            return "sql" in await engine.call(lambda core: core.lora_names)

        await until(restored, "decode1 never got sql back")

        async def reported_back() -> bool:
            return node.load.lora_names == {"sql"}

        # The restore lands on the node before the gateway's next poll reports it.
        await until(reported_back, "no poll reported sql back")
        assert node.is_healthy
        for prompt, tokens in zip(prompts, with_lora, strict=True):
            got, _, _ = await stack.generate(prompt, GREEDY, model="sql")
            assert got == tokens
        unload = gateway_pb2.GatewayUnloadLoraAdapterRequest(lora_name="sql")
        answer = await stack.stub.UnloadLoraAdapter(unload, timeout=120)
        assert answer.message == "Success: LoRA adapter 'sql' removed successfully."
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stack.stub.UnloadLoraAdapter(unload, timeout=120)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND

    run_stack(
        tiny_llama_dir,
        body,
        extra=[
            "--allow-runtime-lora-updating",
            "--health-interval-s",
            "0.2",
            "--served-model-name",
            "tiny-llama",
        ],
        node_extra=["--enable-lora"],
    )


def test_runtime_updates_need_the_gateways_flag(tiny_llama_dir: Path, adapter: Path) -> None:
    async def body(stack: Stack) -> None:
        base_url = f"http://127.0.0.1:{stack.gateway.http_port}"
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            load = {"lora_name": "sql", "lora_path": str(adapter)}
            assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 404
        with pytest.raises(grpc.aio.AioRpcError) as error:  # the gRPC API's, naming the flag
            await stack.stub.LoadLoraAdapter(
                gateway_pb2.GatewayLoadLoraAdapterRequest(**load), timeout=10
            )
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--allow-runtime-lora-updating" in (error.value.details() or "")
        # A node without LoRA refuses the call itself, naming the flag.
        _, (server, _) = next(iter(stack.nodes.items()))
        async with node_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.LoadLoraAdapter(
                    common_pb2.LoadLoraAdapterRequest(lora_name="sql", lora_path=str(adapter)),
                    timeout=10,
                )
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--enable-lora" in (error.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.UnloadLoraAdapter(
                    common_pb2.UnloadLoraAdapterRequest(lora_name=" "), timeout=10
                )
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (error.value.details() or "").startswith("lora_name:")

    run_stack(tiny_llama_dir, body, colocated=True)


def test_a_pair_with_other_files_under_one_name_is_refused(
    tiny_llama_dir: Path, adapter: Path, expected, tmp_path: Path
) -> None:
    """KV computed with one adapter's weights is wrong for another's: a prefill node whose
    files under the name differ from the decode node's refuses the push, naming both
    fingerprints, and no wrong tokens reach the client."""
    other = tmp_path / "other"
    write_adapter(other, tiny_llama_dir, seed=6)
    prompts, _, _ = expected

    async def body(stack: Stack) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stack.generate(prompts[0], GREEDY, model="sql")  # prefilled on the prefill node
        # A deployment's fault, not the client's: every pair tried, then 503 naming why.
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the decode node loaded other files as LoRA adapter 'sql'" in (
            error.value.details() or ""
        )
        got, _, _ = await stack.generate(prompts[0], GREEDY)  # the base model is unaffected
        assert got == expected[2][0]
        await stack.wait_all_free()

    run_stack(
        tiny_llama_dir,
        body,
        extra=["--lora-modules", "sql", "--served-model-name", "tiny-llama"],
        prefill_extra=["--lora-modules", f"sql={adapter}"],
        decode_extra=["--lora-modules", f"sql={other}"],
    )
