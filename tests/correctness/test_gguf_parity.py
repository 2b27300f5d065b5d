"""SmolLM2-135M-Instruct from its GGUF (Q4_1): greedy ids equal transformers' own GGUF loader.

The reference (``smollm2_reference`` in conftest) dequantizes the same file with transformers'
``from_pretrained(dir, gguf_file=...)``; the engine loads it with ours. Both run in fp32, so the
8 chat prompts x 32 tokens must agree exactly, batched here, one at a time there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine import LLM, SamplingParams

NUM_TOKENS = 32


# The reference loads and dequantizes in Python and decodes one prompt at a time: about a minute
# on an idle 2-core host, several on a loaded one.
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_gguf_greedy_ids_equal_transformers(smollm2_gguf: Path, smollm2_reference) -> None:
    prompts, expected = smollm2_reference
    # transformers keeps fp32 K/V: compare like with like.
    llm = LLM(
        smollm2_gguf,
        dtype="float32",
        kv_cache_dtype="float32",
        max_model_len=256,
        kv_cache_memory=64 << 20,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    # The first answer is the quickstart's: the model names Paris.
    assert "Paris" in smollm2_tokenizer_text(smollm2_gguf, expected[0])


def smollm2_tokenizer_text(gguf_path: Path, token_ids: list[int]) -> str:
    from gateway.text.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(gguf_path).decode(token_ids)
