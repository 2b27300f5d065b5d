"""Prompt logprobs through the whole stack: the prefill node (disaggregated) or the colocated
node computes them, the gateway carries them to the gRPC API's first delta, to the OpenAI
completions' legacy logprobs with ``echo`` (what lm-evaluation-harness sends for loglikelihood
tasks) and to vLLM's ``prompt_logprobs`` field; each equals the single-process engine's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest

from gateway.http_api import choice_fanout
from pdserve.v1 import common_pb2, gateway_pb2
from services.engine import LLM, SamplingParams
from support.inprocess_stack import MAX_MODEL_LEN, Stack, run_stack

TOP = 2


@pytest.fixture(scope="module")
def case(
    tiny_llama_dir: Path,
) -> tuple[list[int], list[dict[int, float] | None], list[int | None]]:
    """A prompt, the offline engine's prompt logprobs for it and its tokens' ranks (the nodes'
    settings)."""
    prompt = [random.Random(3).randrange(5, 4000) for _ in range(70)]  # two 64-token chunks
    llm = LLM(
        tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    (output,) = llm.generate([prompt], params)
    assert output.prompt_logprobs is not None
    entries = output.prompt_logprobs
    return (
        prompt,
        [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in entries],
        [None if e is None else e[token].rank for e, token in zip(entries, prompt, strict=True)],
    )


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_prompt_logprobs_reach_both_apis(tiny_llama_dir: Path, case, colocated: bool) -> None:
    prompt, expected, ranks = case

    def logprob_of(position: int) -> float:
        entry = expected[position]
        assert entry is not None
        return entry[prompt[position]]

    async def body(stack: Stack) -> None:
        # gRPC: the first delta carries prompt tokens 1.. with their alternatives.
        sampling = common_pb2.SamplingParams(
            max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP
        )
        request = gateway_pb2.GatewayGenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling
        )
        deltas = [
            e.delta async for e in stack.stub.Generate(request, timeout=60) if e.delta.token_ids
        ]
        first = deltas[0].prompt_logprobs
        assert [lp.token_id for lp in first] == prompt[1:]
        for position, lp in enumerate(first, start=1):
            assert lp.logprob == pytest.approx(logprob_of(position), abs=1e-3)
            assert lp.rank == ranks[position]
            assert len(lp.top_token_ids) >= TOP
        assert not any(d.prompt_logprobs for d in deltas[1:])

        base = f"http://127.0.0.1:{stack.gateway.http_port}"
        model = stack.gateway.frontend.served_model_name
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            # lm-evaluation-harness's loglikelihood request: echo the prompt with logprobs.
            response = await http.post(
                "/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 1, "logprobs": 1,
                      "echo": True, "temperature": 0},
            )  # fmt: skip
            assert response.status_code == 200, response.text
            legacy = response.json()["choices"][0]["logprobs"]
            assert len(legacy["token_logprobs"]) == len(prompt) + 1
            assert legacy["token_logprobs"][0] is None and legacy["top_logprobs"][0] is None
            for position in range(1, len(prompt)):
                value = legacy["token_logprobs"][position]
                assert value == pytest.approx(logprob_of(position), abs=1e-3)
            # vLLM's prompt_logprobs field, keyed by token id.
            response = await http.post(
                "/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": TOP},
            )
            field = response.json()["choices"][0]["prompt_logprobs"]
            assert field[0] is None and len(field) == len(prompt)
            for position in range(1, len(prompt)):
                entry = field[position][str(prompt[position])]
                assert entry["logprob"] == pytest.approx(logprob_of(position), abs=1e-3)
                # The prompt's token: its rank in the vocabulary, among the top TOP or not.
                assert entry["rank"] == ranks[position]
                # The alternatives: the top TOP, ranked by place.
                assert {v["rank"] for v in field[position].values()} >= set(range(1, TOP + 1))
            assert any(rank > TOP for rank in ranks[1:])  # type: ignore[operator]
            # With no alternatives asked, the prompt's token alone, still with its rank.
            response = await http.post(
                "/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0},
            )
            field = response.json()["choices"][0]["prompt_logprobs"]
            assert [list(entry) for entry in field[1:]] == [[str(t)] for t in prompt[1:]]
            own = [entry[str(t)]["rank"] for entry, t in zip(field[1:], prompt[1:], strict=True)]
            assert own == ranks[1:]
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body, colocated=colocated)


def test_a_prompts_n_choices_share_one_computation_of_its_prompt_logprobs(
    tiny_llama_dir: Path, case, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only each prompt's first choice asks the nodes for prompt logprobs (a prefill that scores
    # every position and skips the prefix cache); the response gives every choice the same, in
    # the JSON body and in each choice's first streamed chunk.
    prompt, expected, _ = case
    asked: list[int | None] = []
    real_generate_text = choice_fanout.generate_text

    def recording(frontend, request, options):  # type: ignore[no-untyped-def]
        asked.append(request.sampling.prompt_logprobs)
        return real_generate_text(frontend, request, options)

    monkeypatch.setattr(choice_fanout, "generate_text", recording)
    echoed = [expected[p][prompt[p]] for p in range(1, len(prompt))]  # type: ignore[index]

    async def body(stack: Stack) -> None:
        base = f"http://127.0.0.1:{stack.gateway.http_port}"
        model = stack.gateway.frontend.served_model_name
        request = {
            "model": model, "prompt": [prompt, prompt[:40]], "n": 3, "max_tokens": 2,
            "logprobs": 1, "echo": True, "prompt_logprobs": TOP, "temperature": 1.0, "seed": 5,
        }  # fmt: skip
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            response = await http.post("/v1/completions", json=request)
            assert response.status_code == 200, response.text
            choices = response.json()["choices"]
            assert asked == [TOP, None, None, TOP, None, None]
            assert [c["index"] for c in choices] == list(range(6))
            for choice in choices:
                length = len(prompt) if choice["index"] < 3 else 40
                legacy = choice["logprobs"]["token_logprobs"][:length]
                assert legacy[0] is None
                assert legacy[1:] == pytest.approx(echoed[: length - 1], abs=1e-3)
                field = choice["prompt_logprobs"]
                assert len(field) == length
                assert field == choices[choice["index"] // 3 * 3]["prompt_logprobs"]

            asked.clear()
            first: dict[int, dict] = {}
            async with http.stream(
                "POST", "/v1/completions", json={**request, "stream": True}
            ) as sse:
                assert sse.status_code == 200
                async for line in sse.aiter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            first.setdefault(choice["index"], choice)
            assert asked == [TOP, None, None, TOP, None, None]
            for index, choice in first.items():
                length = len(prompt) if index < 3 else 40
                legacy = choice["logprobs"]["token_logprobs"][:length]
                assert legacy[1:] == pytest.approx(echoed[: length - 1], abs=1e-3)
                assert len(choice["prompt_logprobs"]) == length
            assert sorted(first) == list(range(6))
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body, colocated=True)
