"""The offline ``LLM``'s logprobs in vLLM's shape: ``{token id: Logprob}`` per position, each
with the raw logprob, the rank (the top-n's places 1 .. n, a sampled or prompt token outside them
its rank in the whole vocabulary) and the token's text; checked against a Hugging Face forward
pass over the same tokens (fp32, on the same device: the CPU, and a GPU where there is one)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine import LLM, Logprob, SamplingParams
from services.engine.logprob import logprob_entries

TEXT = "The quick brown fox jumps over"
TOP = 2
KV_CACHE_MEMORY = 4 << 20
"""2,048 tokens of the tiny model (on a GPU the default would be most of its memory)."""


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Where the engine under test and its reference both run."""
    return request.param


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path, device: str) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_dtype="float32", max_model_len=128,
               kv_cache_memory=KV_CACHE_MEMORY, device=device)  # fmt: skip


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path, device: str) -> torch.nn.Module:
    return (
        AutoModelForCausalLM.from_pretrained(
            tiny_llama_dir, dtype=torch.float32, local_files_only=True
        )
        .to(device)
        .eval()
    )


def reference_rows(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` on the CPU: row p is the logprobs of the token after
    ``tokens[: p + 1]``."""
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=model.device)).logits[0].log_softmax(-1).cpu()


def check_entry(entry: dict[int, Logprob], token: int, row: torch.Tensor, num_top: int) -> None:
    """One position's entries against the reference ``row`` ``[vocab]``."""
    value = row[token].item()
    assert entry[token].logprob == pytest.approx(value, abs=1e-4)
    rank = entry[token].rank
    assert rank is not None  # 1 + the tokens more likely, up to the two computations' rounding
    assert 1 + int((row > value + 1e-4).sum()) <= rank <= 1 + int((row > value - 1e-4).sum())
    top_values, top_ids = row.topk(num_top)
    for place, (top_id, top_value) in enumerate(
        zip(top_ids.tolist(), top_values.tolist(), strict=True), start=1
    ):
        assert entry[top_id].logprob == pytest.approx(top_value, abs=1e-4)
        assert entry[top_id].rank == place
    assert set(entry) == {token, *top_ids.tolist()}


def test_sampled_and_prompt_tokens_carry_logprob_rank_and_text(
    llm: LLM, hf_model: torch.nn.Module
) -> None:
    # At temperature 2 the tiny random model samples far from its top tokens: the ranks of
    # sampled tokens outside the top-n come from the whole vocabulary.
    params = SamplingParams(
        max_tokens=12, temperature=2.0, seed=3, ignore_eos=True, logprobs=TOP, prompt_logprobs=1
    )
    (out,) = llm.generate(TEXT, params, use_tqdm=False)
    tokens = [*out.prompt_token_ids, *out.token_ids]
    rows = reference_rows(hf_model, tokens)
    (completion,) = out.outputs
    assert completion.logprobs is out.logprobs and out.logprobs is not None
    assert len(out.logprobs) == len(out.token_ids)
    start = len(out.prompt_token_ids) - 1  # the row predicting the first generated token
    for i, (entry, token) in enumerate(zip(out.logprobs, out.token_ids, strict=True)):
        check_entry(entry, token, rows[start + i], TOP)
    outside = [entry[t].rank for entry, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert any(rank is not None and rank > TOP for rank in outside)
    assert completion.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids, strict=True))
    )
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for position in range(1, len(out.prompt_token_ids)):
        entry = out.prompt_logprobs[position]
        assert entry is not None
        check_entry(entry, out.prompt_token_ids[position], rows[position - 1], 1)
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    for entry in [*out.logprobs, *out.prompt_logprobs[1:]]:
        assert entry is not None
        for token_id, logprob in entry.items():
            assert logprob.decoded_token == tokenizer.decode([token_id], skip_special_tokens=False)


def test_greedy_tokens_rank_first(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    (out,) = llm.generate(TEXT, params, use_tqdm=False)
    assert out.logprobs is not None
    assert [list(entry) for entry in out.logprobs] == [[token] for token in out.token_ids]
    assert all(entry[t].rank == 1 for entry, t in zip(out.logprobs, out.token_ids, strict=True))


def test_outputs_without_text_carry_no_token_text(
    tiny_llama_dir: Path, device: str, llm: LLM
) -> None:
    params = SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=2, detokenize=False)
    (out,) = llm.generate(TEXT, params, use_tqdm=False)
    assert out.text is None and out.logprobs is not None and out.prompt_logprobs is not None
    entries = [*out.logprobs, *out.prompt_logprobs[1:]]
    assert all(lp.decoded_token is None for entry in entries if entry for lp in entry.values())
    bare = LLM(tiny_llama_dir, dtype="float32", max_model_len=64, skip_tokenizer_init=True,
               kv_cache_memory=KV_CACHE_MEMORY, device=device)  # fmt: skip
    (out,) = bare.generate([out.prompt_token_ids], params, use_tqdm=False)
    assert out.logprobs is not None
    assert all(lp.decoded_token is None for entry in out.logprobs for lp in entry.values())
    assert all(lp.rank is not None for entry in out.logprobs for lp in entry.values())


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(llm: LLM) -> None:
    free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    (whole,) = llm.generate(TEXT, free, use_tqdm=False)
    assert whole.text and whole.logprobs is not None
    stop = whole.text[len(whole.text) // 2 :][:3]  # somewhere inside the greedy text
    (cut,) = llm.generate(TEXT, replace(free, stop=(stop,)), use_tqdm=False)
    assert cut.finish_reason == "stop" and cut.logprobs is not None
    assert len(cut.logprobs) == len(cut.token_ids) < len(whole.token_ids)
    assert cut.logprobs == whole.logprobs[: len(cut.token_ids)]


# --- logprob_entries: the ranks, from the engine's entries --------------------------------------


def test_a_token_among_the_top_takes_its_place_there() -> None:
    # The engine's dict: the token first, then the top-n (here the token is the second best).
    entries = {7: -1.0, 3: -0.5, 9: -2.0}
    got = logprob_entries(entries, 7, 2, num_top=3, decode=None)
    assert list(got) == [7, 3, 9]
    assert {t: (lp.logprob, lp.rank) for t, lp in got.items()} == {
        7: (-1.0, 2),
        3: (-0.5, 1),
        9: (-2.0, 3),
    }


def test_a_token_outside_the_top_takes_its_vocabulary_rank() -> None:
    entries = {42: -6.0, 3: -0.5, 9: -2.0}
    got = logprob_entries(entries, 42, 17, num_top=2, decode=lambda t: f"<{t}>")
    assert [(t, lp.rank, lp.decoded_token) for t, lp in got.items()] == [
        (42, 17, "<42>"),
        (3, 1, "<3>"),
        (9, 2, "<9>"),
    ]


def test_equal_logprobs_keep_the_engines_order() -> None:
    entries = {5: -9.0, 8: -1.0, 2: -1.0}
    got = logprob_entries(entries, 5, None, num_top=2, decode=None)
    assert [(t, lp.rank) for t, lp in got.items()] == [(5, None), (8, 1), (2, 2)]
