"""Greedy token ids equal Hugging Face ``generate()`` on the same checkpoint (fp32).

Each architecture's reference is computed once, one prompt at a time (no padding in the
reference), and every engine configuration below must reproduce it exactly, batched: plain
continuous batching, chunked prefill forced by a small token budget, preemption forced by a
small KV cache, prefix-cache hits from prompts that share long prefixes, and speculative
decoding's kept proposals. Each runs on both attention backends: the portable torch path and the
native CPU kernel.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine import LLM, SamplingParams
from services.models.tiny import ARCHS as TINY_ARCHS

pytestmark = pytest.mark.slow

PROMPT_LENS = (1, 5, 16, 17, 64, 100, 200, 300)
NUM_OUTPUT_TOKENS = 32
MAX_MODEL_LEN = 352
BLOCK_SIZE = 16
# Every architecture the tiny builder makes but Mistral, whose layers are Llama's (its own
# differences, the window and head_dim, are the config's: tests/models/test_loader.py).
ARCHS = tuple(arch for arch in TINY_ARCHS if arch != "mistral")


def random_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def shared_prefix_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """Eight prompts over two long prefixes (150 and 70 tokens) with distinct suffixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, vocab_size) for _ in range(n)] for n in (150, 70)]
    return [
        prefixes[i % 2] + [rng.randrange(5, vocab_size) for _ in range(1 + 13 * i)]
        for i in range(8)
    ]


def cyclic_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """Short random cycles repeated (3 x 6 tokens ... 4 x 12): a random model's greedy text
    continues some of them, so speculative decoding's proposals are kept."""
    rng = random.Random(seed)
    return [
        [rng.randrange(5, vocab_size) for _ in range(cycle)] * repeats
        for cycle, repeats in ((3, 6), (5, 4), (8, 3), (2, 10), (7, 5), (4, 12))
    ]


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    )
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NUM_OUTPUT_TOKENS,
                do_sample=False,
                eos_token_id=None,  # the engine ignores EOS below, so both emit 32 tokens
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def kv_bytes(model_dir: Path, num_blocks: int) -> int:
    """kv_cache_memory that yields exactly ``num_blocks`` fp32 blocks for this checkpoint."""
    raw = json.loads((model_dir / "config.json").read_text())
    raw = raw.get("text_config") or raw  # a multimodal Gemma 3's language model
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    per_block = (
        2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * head_dim * BLOCK_SIZE * 4
    )
    return num_blocks * per_block


@pytest.fixture(scope="module", params=ARCHS)
def case(request: pytest.FixtureRequest, tiny_model_factory) -> dict:
    model_dir = tiny_model_factory(request.param)
    vocab_size = (
        AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        .config.get_text_config()
        .vocab_size
    )
    prompts = random_prompts(vocab_size, seed=1)
    shared = shared_prefix_prompts(vocab_size, seed=2)
    cyclic = cyclic_prompts(vocab_size, seed=3)
    return {
        "cyclic": cyclic,
        "cyclic_expected": hf_greedy(model_dir, cyclic),
        "model_dir": model_dir,
        "prompts": prompts,
        "expected": hf_greedy(model_dir, prompts),
        "shared": shared,
        "shared_expected": hf_greedy(model_dir, shared),
    }


GREEDY = SamplingParams(max_tokens=NUM_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(params=["torch", "native"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def make_llm(model_dir: Path, backend: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", kv_bytes(model_dir, num_blocks=256))
    return LLM(
        model_dir,
        dtype="float32",
        kv_cache_dtype="float32",  # transformers keeps fp32 K/V: compare like with like
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        attention_backend=backend,
        **kwargs,
    )


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY)
    assert all(o.finish_reason == "length" for o in outputs)
    assert llm.engine.stats().num_blocks_used == 0
    return [o.token_ids for o in outputs]


def test_batched_greedy_matches_hf(case: dict, backend: str) -> None:
    llm = make_llm(case["model_dir"], backend)
    assert generate(llm, case["prompts"]) == case["expected"]


def test_chunked_prefill_matches_hf(case: dict, backend: str) -> None:
    # A 24-token budget splits every long prompt into chunks that share steps with decodes.
    llm = make_llm(case["model_dir"], backend, max_num_batched_tokens=24)
    assert generate(llm, case["prompts"]) == case["expected"]


def test_preemption_matches_hf(case: dict, backend: str) -> None:
    # 23 blocks hold 368 tokens; the batch needs ~1,060, so requests are preempted and recomputed.
    kv_cache_memory = kv_bytes(case["model_dir"], num_blocks=23)
    llm = make_llm(case["model_dir"], backend, kv_cache_memory=kv_cache_memory)
    assert generate(llm, case["prompts"]) == case["expected"]
    assert llm.engine.stats().num_preemptions_total > 0


def test_prefix_cache_hits_match_hf(case: dict, backend: str) -> None:
    llm = make_llm(case["model_dir"], backend, max_num_seqs=2)
    # max_num_seqs=2 admits requests a few at a time, so later ones hit blocks that earlier
    # requests computed; the second generate() hits what the first left in the cache.
    assert generate(llm, case["shared"]) == case["shared_expected"]
    outputs = llm.generate(case["shared"], GREEDY)
    assert [o.token_ids for o in outputs] == case["shared_expected"]
    assert all(o.num_cached_tokens >= 64 for o in outputs)
    assert llm.engine.stats().prefix_cache_hit_rate > 0.3


def test_speculative_decoding_matches_hf(case: dict, backend: str) -> None:
    # Proposals from the prompt and the outputs so far, verified as decode rows: the kept ones
    # must be the tokens HF generates. The cyclic prompts get some kept, the random ones few;
    # a small cache preempts some requests between verifications.
    llm = make_llm(
        case["model_dir"],
        backend,
        kv_cache_memory=kv_bytes(case["model_dir"], num_blocks=40),
        speculative_config={
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        },  # fmt: skip
    )
    prompts = case["cyclic"] + case["prompts"]
    assert generate(llm, prompts) == case["cyclic_expected"] + case["expected"]
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens_total > 0, "no proposal was kept: nothing verified"
    assert stats.num_draft_tokens_total > stats.num_accepted_tokens_total
    assert stats.num_preemptions_total > 0
