"""Guided decoding at llguidance's limits.

- A choice of thousands of strings yields one of them: llguidance refuses a grammar row of more
  than 2,000 items, but only once it runs, so the choices must not be one rule of alternatives.
- A grammar llguidance gives up on while the request runs (a limit hit after admission) ends the
  request with ``error`` and a message naming the field, never with ``stop`` and a text that
  does not match; a prefill node's request frees its blocks rather than holding them for a push.
- The node's compile, off the engine thread, drives the grammar over its first token, so the
  grammars that fail at once are refused there, before the engine thread spends seconds on them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import llguidance
import pytest
from tokenizers import Tokenizer

from services.engine import LLM, EngineCore, SamplingParams
from services.guided_decoding import MAX_CHOICES, GuidedDecoding, GuidedKind

PROMPT = [11, 400, 27, 3000, 12, 9]
ROW_LIMIT = 2_000
"""llguidance's default ``max_items_in_row``."""
TOO_WIDE = "wide: " + " | ".join(json.dumps(f"label{i}") for i in range(ROW_LIMIT + 1))
"""A Lark rule one alternative past the row limit: fine to compile, fatal once predicted."""


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=4 << 20)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))


def run(engine: EngineCore, request_id: str) -> tuple[list[int], str | None, str | None]:
    """Step ``engine`` until ``request_id`` finishes: (its tokens, finish reason, error)."""
    token_ids: list[int] = []
    while True:
        for out in engine.step():
            assert out.request_id == request_id
            token_ids.extend(out.new_token_ids)
            if out.finished:
                return token_ids, out.finish_reason, out.error


def uncompiled_matcher(engine: EngineCore, guided: GuidedDecoding) -> llguidance.LLMatcher:
    """``guided``'s matcher without the compile's first-token probe: a grammar that fails only
    once it runs, as one that fails further along than the probe looks does."""
    tokenizer = engine.structured_outputs.llg_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, guided.to_grammar(), log_level=0)
    assert not matcher.is_error()
    return matcher


@pytest.mark.parametrize("num_choices", [ROW_LIMIT, 2_500, MAX_CHOICES])
def test_thousands_of_choices_yield_one_of_them(llm, tokenizer, num_choices: int) -> None:
    choices = [f"label{i}" for i in range(num_choices)]
    params = SamplingParams(max_tokens=30, temperature=0.0, guided=GuidedDecoding.choice(choices))
    (out,) = llm.generate([PROMPT], params)
    assert tokenizer.decode(out.token_ids) in choices
    assert out.finish_reason == "stop"


def test_choices_that_prefix_each_other_and_need_quoting_are_exact(llm, tokenizer) -> None:
    choices = ["a", "ab", "abc", 'say "hi"', "back\\slash", "new\nline", ".*", "日本"]
    for seed in range(8):
        params = SamplingParams(max_tokens=12, seed=seed, guided=GuidedDecoding.choice(choices))
        (out,) = llm.generate([PROMPT], params)
        assert tokenizer.decode(out.token_ids) in choices, seed
        assert out.finish_reason == "stop"


@pytest.mark.parametrize("hold_kv", [False, True], ids=["colocated", "prefill-held"])
def test_a_grammar_that_fails_while_running_ends_in_error_not_stop(llm, hold_kv: bool) -> None:
    engine = llm.engine
    guided = GuidedDecoding(GuidedKind.GRAMMAR, f'start: "b" wide | "a"\n{TOO_WIDE}')
    matcher = uncompiled_matcher(engine, guided)
    # Force the branch that predicts the wide rule: the first token the matcher consumes fails.
    (b_token,) = engine.structured_outputs.llg_tokenizer().tokenize_str("b")
    params = SamplingParams(
        max_tokens=20, temperature=0.0, guided=guided, logit_bias=((b_token, 100.0),)
    )
    request_id = f"fails-{hold_kv}"
    engine.add_request(request_id, PROMPT, params, hold_kv=hold_kv, grammar=matcher)
    token_ids, reason, error = run(engine, request_id)
    assert reason == "error"
    assert error is not None and "guided.grammar" in error and "max is 2000" in error
    assert token_ids == []  # the token the grammar could not take is not handed out
    stats = engine.stats()
    assert stats.num_blocks_used == 0 and stats.num_held == 0
    assert not engine.release_kv(request_id)
    assert len(engine.structured_outputs) == 0


def test_a_commit_whose_grammar_fails_ends_in_error_not_stop(llm) -> None:
    engine = llm.engine
    guided = GuidedDecoding(GuidedKind.GRAMMAR, f'start: "b" wide | "a"\n{TOO_WIDE}')
    params = SamplingParams(max_tokens=20, guided=guided)
    matcher = uncompiled_matcher(engine, guided)
    assert engine.reserve("bad-commit", PROMPT, params, grammar=matcher) is not None
    (b_token,) = engine.structured_outputs.llg_tokenizer().tokenize_str("b")
    out = engine.commit("bad-commit", b_token)  # the prefill node sampled it under the same grammar
    assert out.finish_reason == "error"
    assert out.error is not None and "guided.grammar" in out.error
    assert engine.stats().num_blocks_used == 0 and len(engine.structured_outputs) == 0


@pytest.mark.parametrize(
    ("guided", "message"),
    [
        (GuidedDecoding(GuidedKind.GRAMMAR, f"start: wide\n{TOO_WIDE}"), "max is 2000"),
        (
            GuidedDecoding.json_schema({"type": "string", "pattern": "^x{1000}{1000}$"}),
            "too many expressions",
        ),
    ],
    ids=["wide-rule", "huge-repeat"],
)
def test_the_compile_refuses_a_grammar_that_fails_on_its_first_token(
    llm, guided: GuidedDecoding, message: str
) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match=re.escape(guided.field_name)) as refusal:
        engine.add_request("bad", PROMPT, SamplingParams(guided=guided))
    assert message in str(refusal.value)
    assert "<state>" not in str(refusal.value)  # llguidance's parser dump is left out
    assert not engine.has_unfinished_requests and len(engine.structured_outputs) == 0
