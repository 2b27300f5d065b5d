"""The gateway in front of real nodes over real gRPC on localhost: one prefill node and two
decode nodes (KV moved by the in-process loopback transport), or a colocated node.

Through the public gRPC API: greedy tokens equal the single-process engine's; a full decode
node and a dead decode node are retried on the other one before any token is sent; a client
that goes away frees the blocks on every node; bad requests get the right status codes.

``PDSERVE_TEST_TLS=1`` runs every stack here with mutual TLS between the gateway and the nodes
and between prefill and decode (``tests/integration/test_tls.py`` always does, for a few).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2
from services.engine import LLM, SamplingParams
from support.inprocess_stack import (
    GREEDY,
    MAX_MODEL_LEN,
    Stack,
    node_channel,
    run_stack,
)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path):
    """Greedy tokens of the single-process engine for a few prompts."""
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in (3, 16, 40, 100, 150)]
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return prompts, [list(o.token_ids) for o in offline.generate(prompts, params)]


def test_disaggregated_greedy_equals_the_single_engine(tiny_llama_dir: Path, expected) -> None:
    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        results = await asyncio.gather(*(stack.generate(p) for p in prompts))
        assert [r[0] for r in results] == tokens
        for (_, text, finished), ids in zip(results, tokens, strict=True):
            assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert finished.usage.completion_tokens == 8
            assert finished.usage.prompt_tokens > 0
            assert text == stack.gateway.frontend.tokenizer.decode(ids)
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)


def test_a_conversation_returns_to_the_decode_node_that_holds_its_turns(
    tiny_llama_dir: Path,
) -> None:
    """A chat's next turn goes back to the decode node that served the last one, though
    another is less busy (prefix affinity within the load rule), and that node's reservation
    takes the earlier turns from its prefix cache instead of having them pushed again; the
    tokens are the single engine's."""
    rng = random.Random(21)
    first = [rng.randrange(5, 4096) for _ in range(3 * 16 + 5)]

    async def body(stack: Stack) -> None:
        engines = [engine for name, (_, engine) in stack.nodes.items() if name.startswith("decode")]
        turn1, _, _ = await stack.generate(first)
        second = [*first, *turn1, *[rng.randrange(5, 4096) for _ in range(6)]]
        hits = [engine.stats.prefix_cache_hit_tokens for engine in engines]
        # Something else keeps the conversation's node busy meanwhile: the least loaded one is
        # now the other decode node.
        busy = common_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        background = asyncio.ensure_future(stack.generate([7] * 20, busy))
        await asyncio.sleep(0.2)
        turn2, _, _ = await stack.generate(second)
        await background
        gained = [e.stats.prefix_cache_hit_tokens - h for e, h in zip(engines, hits, strict=True)]
        # The earlier turns' full blocks (the prompt's 53 tokens and 8 answered: 3 blocks).
        assert sorted(gained) == [0, 48]
        offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        assert turn2 == list(offline.generate([second], params)[0].token_ids)
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)


def test_bad_words_are_banned_on_both_legs(tiny_llama_dir: Path, expected) -> None:
    """The prefill node samples the first token, the decode node the rest: both apply them."""
    prompts, tokens = expected
    first, second = tokens[3][:2]

    def banning(*words: list[int]) -> common_pb2.SamplingParams:
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(GREEDY)
        sampling.bad_words_token_ids.extend(common_pb2.TokenSequence(ids=w) for w in words)
        return sampling

    async def body(stack: Stack) -> None:
        banned_first, _, _ = await stack.generate(prompts[3], banning([first]))
        assert first not in banned_first
        banned_pair, _, _ = await stack.generate(prompts[3], banning([first, second]))
        assert banned_pair[0] == first and banned_pair[1] != second
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_a_salted_prompt_shares_the_prefix_cache_only_within_its_salt(
    tiny_llama_dir: Path, expected, colocated: bool
) -> None:
    prompts, tokens = expected
    prompt = prompts[4]  # 150 tokens: prefilled on the prefill node when disaggregated

    def salted(salt: str | None) -> common_pb2.SamplingParams:
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(GREEDY)
        if salt is not None:
            sampling.cache_salt = salt
        return sampling

    async def body(stack: Stack) -> None:
        cached = []
        for salt in ("tenant-a", "tenant-a", "tenant-b", None, None):
            ids, _, finished = await stack.generate(prompt, salted(salt))
            assert ids == tokens[4]  # a salt changes what is shared, never the tokens
            cached.append(finished.usage.cached_prompt_tokens)
        whole_blocks = len(prompt) // 16 * 16
        assert cached == [0, whole_blocks, 0, 0, whole_blocks]
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body, colocated=colocated)


def test_colocated_greedy_equals_the_single_engine(tiny_llama_dir: Path, expected) -> None:
    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        results = await asyncio.gather(*(stack.generate(p) for p in prompts))
        assert [r[0] for r in results] == tokens
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body, colocated=True)


def test_short_prompts_are_prefilled_on_the_decode_node(tiny_llama_dir: Path, expected) -> None:
    """--local-prefill-max-tokens 40: the prompts of 3, 16 and 40 tokens never reach the prefill
    node (its engine saw two requests), the greedy tokens are the single engine's either way."""
    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        results = await asyncio.gather(*(stack.generate(p) for p in prompts))
        assert [r[0] for r in results] == tokens
        registry = stack.gateway.metrics.registry
        attempts = {
            route: registry.get_sample_value("pdserve:request_attempts_total", {"route": route})
            for route in ("local_prefill", "disaggregated")
        }
        assert attempts == {"local_prefill": 3.0, "disaggregated": 2.0}
        _, prefill_engine = stack.nodes["prefill"]
        stats = await prefill_engine.call(lambda core: core.stats())
        assert stats.prefix_cache_queried_tokens == 100 + 150  # the long prompts only
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body, extra=["--local-prefill-max-tokens", "40"])


def test_a_request_ending_at_its_first_token_is_served_by_the_prefill_node_alone(
    tiny_llama_dir: Path, expected
) -> None:
    """max_tokens=1 needs no decode node: with both gone (drained, not yet noticed by the
    gateway's polls), every prompt still gets the single engine's first token from the prefill
    node, with no attempt on a decode node, and no block left held there."""
    prompts, tokens = expected
    one = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def body(stack: Stack) -> None:
        for name in ("decode0", "decode1"):
            server, engine = stack.nodes.pop(name)
            await server.drain()
            engine.shutdown()
        results = await asyncio.gather(*(stack.generate(p, one) for p in prompts))
        assert [r[0] for r in results] == [t[:1] for t in tokens]
        for _, _, finished in results:
            assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert finished.usage.completion_tokens == 1 and finished.num_retries == 0
        registry = stack.gateway.metrics.registry
        attempts = {
            route: registry.get_sample_value("pdserve:request_attempts_total", {"route": route})
            for route in ("prefill_only", "disaggregated")
        }
        assert attempts == {"prefill_only": len(prompts), "disaggregated": None}
        # A first token that is a stop token ends the request as "stop", as the node says.
        stopping = common_pb2.SamplingParams(
            max_tokens=1, temperature=0.0, stop_token_ids=[tokens[2][0]]
        )
        _, _, finished = await stack.generate(prompts[2], stopping)
        assert finished.finish_reason == common_pb2.FINISH_REASON_STOP
        # A request that goes on needs a decode node, and says so.
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stack.generate(prompts[4])
        assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)


def test_a_full_decode_node_is_retried_on_another(tiny_llama_dir: Path, expected) -> None:
    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        # Another client's reservation fills decode0 behind the gateway's back (its pool does
        # not poll during the test, so decode0 still looks idle and, listed first, is tried).
        server, _ = stack.nodes["decode0"]
        async with node_channel(f"127.0.0.1:{server.port}") as channel:
            holder = decode_pb2_grpc.DecodeServiceStub(channel).Generate(
                decode_pb2.GenerateRequest(
                    prompt_token_ids=[7] * 250, sampling=GREEDY, kv_source="x", lease_ms=30_000
                ),
                timeout=30,
            )
            assert (await holder.read()).WhichOneof("event") == "reservation"
            result = await stack.generate(prompts[4])
            holder.cancel()
        assert result[0] == tokens[4]
        assert result[2].num_retries == 1
        retries = stack.gateway.metrics.retries.labels(cause="decode_full")._value.get()
        assert retries == 1
        await stack.wait_all_free()

    # 300 KiB of bf16 KV (the CPU default) is 18 blocks of 16 tiny-model tokens (1 KiB per
    # token): the 250-token reservation leaves 2, and the 150-token prompt needs 10.
    run_stack(tiny_llama_dir, body, decode_kv=("300KiB", "5MiB"))


def test_a_dead_decode_node_is_retried_before_the_first_token(tiny_llama_dir, expected) -> None:
    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        server, engine = stack.nodes["decode0"]
        await server.drain()  # gone; the gateway's pool has not polled since
        engine.shutdown()
        del stack.nodes["decode0"]
        result = await stack.generate(prompts[2])
        assert result[0] == tokens[2]
        assert result[2].num_retries == 1
        assert not stack.gateway.pool.decode[0].is_healthy
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)


def test_a_client_that_goes_away_frees_every_node(tiny_llama_dir: Path) -> None:
    async def body(stack: Stack) -> None:
        sampling = common_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        for _ in range(3):
            call = stack.stub.Generate(
                gateway_pb2.GatewayGenerateRequest(
                    token_ids=gateway_pb2.TokenIds(ids=list(range(10, 50))), sampling=sampling
                ),
                timeout=60,
            )
            first = await call.read()
            assert first.WhichOneof("event") == "delta"
            call.cancel()
        await stack.wait_all_free()
        # ... and every node still serves.
        _, _, finished = await stack.generate([1, 2, 3])
        assert finished.usage.completion_tokens == 8

    run_stack(tiny_llama_dir, body)


def test_bad_requests_get_clear_statuses(tiny_llama_dir: Path) -> None:
    async def body(stack: Stack) -> None:
        cases = [
            (dict(token_ids=gateway_pb2.TokenIds(ids=[])), grpc.StatusCode.INVALID_ARGUMENT,
             "empty"),
            (dict(token_ids=gateway_pb2.TokenIds(ids=[10**6])), grpc.StatusCode.INVALID_ARGUMENT,
             "token_ids"),
            (dict(text="hi", sampling=common_pb2.SamplingParams(top_p=3)),
             grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
            (dict(text="hi", sampling=common_pb2.SamplingParams(max_tokens=10_000)),
             grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
            (dict(text="hi", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "gpt-9"),
            # The nodes schedule fcfs: a priority they would ignore is refused by them.
            (dict(text="hi", sampling=common_pb2.SamplingParams(priority=2)),
             grpc.StatusCode.INVALID_ARGUMENT, "priority 2 needs"),
            (dict(), grpc.StatusCode.INVALID_ARGUMENT, "input"),
            (dict(text="hi", sampling=common_pb2.SamplingParams(cache_salt="")),
             grpc.StatusCode.INVALID_ARGUMENT, "cache_salt"),
            (dict(chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="x")])),
             grpc.StatusCode.INVALID_ARGUMENT, "role"),
        ]  # fmt: skip
        for fields, code, needle in cases:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in stack.stub.Generate(
                    gateway_pb2.GatewayGenerateRequest(**fields), timeout=10
                ):
                    pass
            assert error.value.code() == code, fields
            assert needle in error.value.details(), (fields, error.value.details())
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body)


def test_api_keys_guard_the_grpc_api(tiny_llama_dir: Path) -> None:
    async def body(stack: Stack) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stack.generate([1, 2, 3])
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stack.generate([1, 2, 3], metadata=(("authorization", "Bearer nope"),))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        _, _, finished = await stack.generate(
            [1, 2, 3], metadata=(("authorization", "Bearer sesame"),)
        )
        assert finished.usage.completion_tokens == 8
        models = await stack.stub.ListModels(
            gateway_pb2.ListModelsRequest(), metadata=(("authorization", "Bearer sesame"),)
        )
        assert models.models[0].max_model_len == MAX_MODEL_LEN

    run_stack(tiny_llama_dir, body, colocated=True, extra=("--api-key", "sesame"))


def test_openai_client_through_the_disaggregated_stack(tiny_llama_dir: Path, expected) -> None:
    import httpx
    import openai

    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        tokenizer = stack.gateway.frontend.tokenizer
        base = f"http://127.0.0.1:{stack.gateway.http_port}"
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        greedy = dict(max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
        model = stack.gateway.frontend.served_model_name
        plain = await client.completions.create(model=model, prompt=prompts[3], **greedy)
        assert plain.choices[0].text == tokenizer.decode(tokens[3])
        assert plain.choices[0].finish_reason == "length"
        assert plain.usage.completion_tokens == 8
        streamed = ""
        async for chunk in await client.completions.create(
            model=model, prompt=prompts[3], stream=True, **greedy
        ):
            streamed += chunk.choices[0].text if chunk.choices else ""
        assert streamed == plain.choices[0].text
        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "héllo 😀"}], **greedy
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage.completion_tokens == 8
        # The Responses API is the same chat, answered as a response (streamed too).
        greedy_chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
        )
        response = await client.responses.create(
            model=model, input="hi", max_output_tokens=8, temperature=0
        )
        assert response.output_text == greedy_chat.choices[0].message.content
        streamed_response = await client.responses.create(
            model=model, input="hi", max_output_tokens=8, temperature=0, stream=True
        )
        events = [event async for event in streamed_response]
        assert events[-1].response.output_text == response.output_text
        # A continuation: the stored turn and the new input, as the chat of the whole talk.
        follow = await client.responses.create(
            model=model, input="and?", previous_response_id=response.id, max_output_tokens=8,
            temperature=0,
        )  # fmt: skip
        talk = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": response.output_text},
                {"role": "user", "content": "and?"}]  # fmt: skip
        same = await client.chat.completions.create(
            model=model, messages=talk, max_tokens=8, temperature=0
        )
        assert follow.output_text == same.choices[0].message.content
        # A named function: the nodes' grammar forces its arguments; they come out as an item.
        weather = {"type": "function", "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}},
            "required": ["city"], "additionalProperties": False}}  # fmt: skip
        called = await client.responses.create(
            model=model, input="weather?", tools=[weather], max_output_tokens=100,
            tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        )  # fmt: skip
        [call] = [item for item in called.output if item.type == "function_call"]
        assert call.name == "get_weather"
        assert json.loads(call.arguments)["city"] in ("Oslo", "Lima")

        # A node's refusal names the field, as the gateway's own checks do.
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            refused = await http.post(
                "/v1/completions", json={"model": model, "prompt": "x", "priority": 3}
            )
            assert refused.status_code == 400
            assert refused.json()["error"]["param"] == "priority"
            assert "--scheduling-policy priority" in refused.json()["error"]["message"]

        # A client that hangs up mid-stream frees the blocks on every node.
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            for _ in range(2):
                async with http.stream(
                    "POST",
                    "/v1/completions",
                    json={
                        "model": model,
                        "prompt": prompts[2],
                        "max_tokens": 200,
                        "stream": True,
                        "ignore_eos": True,
                    },  # fmt: skip
                ) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            break
        await stack.wait_all_free()
        await client.close()

    run_stack(tiny_llama_dir, body)


def test_a_stalled_push_is_recomputed_by_the_decode_node(tiny_llama_dir, expected) -> None:
    """on_kv_failure=recompute: the prefill node stalls mid-push past the reservation's lease;
    the decode node recomputes the prompt itself and the client gets every token from it."""
    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        result = await stack.generate(prompts[2])
        assert result[0] == tokens[2]
        assert result[2].finish_reason == common_pb2.FINISH_REASON_LENGTH
        retries = stack.gateway.metrics.retries.labels(cause="kv_recompute")._value.get()
        assert retries == 1
        await stack.wait_all_free()

    run_stack(
        tiny_llama_dir,
        body,
        extra=("--on-kv-failure", "recompute", "--lease-ms", "300"),
        prefill_extra=("--test-kv-push-pause-s", "2"),
    )


def test_stop_strings_and_reflection_end_to_end(tiny_llama_dir: Path, expected) -> None:
    """A stop string taken from the middle of the greedy text ends it there, across token
    boundaries; and the public API is discoverable through server reflection (as grpcurl
    finds it)."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    prompts, tokens = expected

    async def body(stack: Stack) -> None:
        tokenizer = stack.gateway.frontend.tokenizer
        full = tokenizer.decode(tokens[3])
        stop = full[len(full) // 3 : len(full) // 3 + 2]
        assert stop and full.index(stop) > 0
        _, text, finished = await stack.generate(prompts[3], stop=[stop])
        assert text == full[: full.index(stop)]
        assert finished.finish_reason == common_pb2.FINISH_REASON_STOP
        assert finished.stop_reason == stop
        await stack.wait_all_free()

        reflection = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for response in reflection.ServerReflectionInfo(iter([request])):
            names = {s.name for s in response.list_services_response.service}
            assert "pdserve.v1.GatewayService" in names
            assert "grpc.health.v1.Health" in names

    run_stack(tiny_llama_dir, body)
