"""Greedy token ids through ``LLM(..., attention_backend="triton")`` equal Hugging Face
``generate()`` (fp32). On CPU the kernels run under Triton's interpreter, which runs every
program in Python, so this is the hf-parity suite cut down to a few short prompts: decodes,
chunked prefill sharing steps with decodes, and prefix-cache hits (chunks over a cached
prefix) are each exercised."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine import LLM, SamplingParams

pytest.importorskip("triton")

NUM_OUTPUT_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NUM_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)


def hf_greedy(
    model_dir, prompts: list[list[int]], device: str = "cpu", num_tokens: int = NUM_OUTPUT_TOKENS
) -> list[list[int]]:
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        .to(device)
        .eval()
    )
    with torch.inference_mode():
        return [
            model.generate(
                torch.tensor([p], device=device),
                max_new_tokens=num_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def test_triton_backend_greedy_matches_hf(tiny_llama_dir) -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(5, 4096) for _ in range(40)]
    prompts = [
        [rng.randrange(5, 4096) for _ in range(3)],
        prefix + [rng.randrange(5, 4096) for _ in range(5)],
        prefix + [rng.randrange(5, 4096) for _ in range(9)],
    ]
    expected = hf_greedy(tiny_llama_dir, prompts)
    # A 16-token budget splits the long prompts into chunks that share steps with decodes;
    # max_num_seqs=2 admits the third prompt later, onto the prefix the second one cached.
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        block_size=16,
        max_model_len=128,
        max_num_batched_tokens=16,
        max_num_seqs=2,
        kv_cache_memory=1 << 22,
        attention_backend="triton",
    )
    assert type(llm.engine.runner.backend).__name__ == "TritonPagedAttention"
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert outputs[2].num_cached_tokens >= 32


@pytest.mark.gpu
def test_cuda_greedy_matches_hf_on_the_same_gpu(tiny_llama_dir) -> None:
    """The whole CUDA path in fp32: weights on the GPU, the Triton kernels, decode steps replayed
    as CUDA graphs (batches of 1 to 4 as requests finish), argmax on the device."""
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 4096) for _ in range(n)] for n in (1, 7, 33, 150)]
    lengths = [24, 9, 17, 3]
    expected = [
        hf_greedy(tiny_llama_dir, [p], device="cuda", num_tokens=n)[0]
        for p, n in zip(prompts, lengths, strict=True)
    ]
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        device="cuda",
        max_model_len=256,
        gpu_memory_utilization=0.2,
    )
    assert llm.engine.runner.static_decode is not None
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
