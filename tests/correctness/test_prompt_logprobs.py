"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal a Hugging Face forward pass over
the same prompt (fp32): every prompt token's logprob given the tokens before it, its rank in the
vocabulary, and the top-n alternatives; whole prompts, prompts cut into chunks (one of a single
token), and a prompt whose prefix sits in the prefix cache (it must still be computed, not
skipped)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine import LLM, RequestOutput, SamplingParams

PROMPT_LENS = (15, 17, 1, 2, 45)  # at a budget of 16 the 17 starts with a 1-token chunk
TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The prompts, and for each its HF logprobs ``[len, vocab]``: row p predicts token p + 1."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in PROMPT_LENS]
    with torch.inference_mode():
        logprobs = [model(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]
    return prompts, logprobs


def check(prompt: list[int], expected: torch.Tensor, output: RequestOutput, num_top: int) -> None:
    got = output.prompt_logprobs
    assert got is not None
    assert len(got) == len(prompt) and got[0] is None
    for position in range(1, len(prompt)):
        entry = got[position]
        assert entry is not None
        row = expected[position - 1]
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        # 1 + the tokens more likely, up to those within the two computations' rounding.
        value = row[token].item()
        rank = entry[token].rank
        assert rank is not None
        assert 1 + int((row > value + 1e-4).sum()) <= rank <= 1 + int((row > value - 1e-4).sum())
        top_values, top_ids = row.topk(num_top)
        for place, (token_id, value) in enumerate(
            zip(top_ids.tolist(), top_values.tolist(), strict=True), start=1
        ):
            assert entry[token_id].logprob == pytest.approx(value, abs=1e-4)
            assert entry[token_id].rank == place
        assert set(entry) == {token, *top_ids.tolist()}


@pytest.mark.parametrize("budget", [2048, 16])  # 16: every prompt but the short ones chunked
def test_prompt_logprobs_match_hf(tiny_llama_dir: Path, reference, budget: int) -> None:
    prompts, expected = reference
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        kv_cache_dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=budget,
    )
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    for prompt, logprobs, output in zip(
        prompts, expected, llm.generate(prompts, params), strict=True
    ):
        check(prompt, logprobs, output, TOP)
    # Without the option there are none, and the cache is as it was.
    (plain,) = llm.generate(prompts[:1], SamplingParams(max_tokens=1))
    assert plain.prompt_logprobs is None
    assert llm.engine.stats().num_blocks_used == 0


def test_a_cached_prefix_is_computed_for_its_logprobs(tiny_llama_dir: Path, reference) -> None:
    prompts, expected = reference
    prompt, logprobs = prompts[-1], expected[-1]
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_dtype="float32", max_model_len=128)
    llm.generate([prompt], SamplingParams(max_tokens=1))  # its blocks now in the prefix cache
    (warm,) = llm.generate([prompt], SamplingParams(max_tokens=1))
    assert warm.num_cached_tokens > 0
    params = SamplingParams(max_tokens=1, prompt_logprobs=TOP)
    (output,) = llm.generate([prompt], params)
    assert output.num_cached_tokens == 0
    check(prompt, logprobs, output, TOP)


def test_the_prompt_tokens_rank_needs_no_alternatives(tiny_llama_dir: Path, reference) -> None:
    # vLLM's rank is the token's place in the whole vocabulary, with prompt_logprobs=0 too.
    prompts, expected = reference
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_dtype="float32", max_model_len=128)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (output,) = llm.generate([prompts[-1]], params)
    check(prompts[-1], expected[-1], output, 0)


@pytest.mark.parametrize(
    "arch",
    [
        "smollm3",
        "granite",
        "mixtral",
        "qwen3_moe",
        "granitemoe",
        "olmo2",
        "olmoe",
        "gemma2",
        "gemma3",
        "gemma3_mm",
    ],
)
def test_prompt_logprobs_match_hf_for_architectures_beyond_llama(tiny_model_factory, arch) -> None:
    """SmolLM3's layers without RoPE and Granite's multipliers, the logits' scaling included
    (which greedy tokens cannot show), in the values themselves."""
    model_dir = tiny_model_factory(arch)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in (30, 9)]
    with torch.inference_mode():
        expected = [model(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]
    llm = LLM(model_dir, dtype="float32", kv_cache_dtype="float32", max_model_len=128)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    for prompt, logprobs, output in zip(
        prompts, expected, llm.generate(prompts, params), strict=True
    ):
        check(prompt, logprobs, output, TOP)
