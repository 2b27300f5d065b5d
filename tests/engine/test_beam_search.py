"""``LLM.beam_search`` (vLLM's): one engine round per generated token, ``2 * beam_width``
candidates per beam, EOS completing a beam, ranking by ``cum_logprob / len ** length_penalty``.

End to end it equals greedy ``generate`` at ``beam_width=1`` and a beam search written here over
the Hugging Face model of the same weights (fp32, a full forward per beam and step). The search's
own rules (EOS kept whatever its rank, pruning, ``max_model_len``, ranking) are driven through its
seam, ``beam_search(..., next_logprobs)``, with synthetic distributions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.beam_search import MAX_BEAM_WIDTH, beam_search
from services.engine import (
    LLM,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    FinishReason,
    Logprob,
    SamplingParams,
)
from services.types import SamplingParamError
from support.small_llm import small_llm

PROMPTS = [[10, 11, 12, 13], [42, 43]]
"""Prompts whose searches below have no near-ties (the reference test checks its margins)."""
TOLERANCE = 1e-4  # fp32 engine vs fp32 Hugging Face, per summed logprob


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    # 2 prompts x 4 beams in one round: all fit in one batch.
    return small_llm(tiny_llama_dir, kv_cache_dtype="float32", max_num_seqs=16)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, local_files_only=True
    ).eval()


@pytest.fixture(scope="module")
def eos_id(llm: LLM) -> int:
    (eos,) = llm.engine.model_config.eos_token_ids
    return eos


@pytest.fixture(scope="module")
def eos_prompt(hf_model: PreTrainedModel, eos_id: int) -> list[int]:
    """A prompt whose most likely next token is EOS (random weights put EOS first after about
    one prefix in 500: searched, not hard-coded, so that it holds for any build of the model)."""
    rng = random.Random(0)
    with torch.inference_mode():
        for _ in range(50):
            batch = torch.tensor([[rng.randrange(5, 4000) for _ in range(8)] for _ in range(64)])
            top = hf_model(batch).logits.argmax(-1)  # [64, 8]: the most likely after each prefix
            hits = (top[:, 1:] == eos_id).nonzero().tolist()  # prefixes of two tokens or more
            if hits:
                row, position = hits[0]
                return batch[row, : position + 2].tolist()
    raise AssertionError("no prefix of 3,200 random prompts predicts EOS first")


# --- the reference --------------------------------------------------------------------------


class RefBeam(NamedTuple):
    tokens: list[int]
    cum_logprob: float
    ended_by_eos: bool

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / (len(self.tokens) - self.ended_by_eos) ** length_penalty


def reference_beam_search(
    model: PreTrainedModel,
    prompt: list[int],
    beam_width: int,
    max_tokens: int,
    eos_id: int,
    length_penalty: float = 1.0,
) -> tuple[list[RefBeam], float]:
    """The best ``beam_width`` beams by a plain beam search (each step: a full forward per live
    beam, its ``2 * beam_width`` most likely tokens as candidates, EOS completing), and the
    smallest gap between a kept and a dropped beam at any cut: the margin the engine's rounding
    must stay within for the same choice."""
    live = [RefBeam(prompt, 0.0, False)]
    completed: list[RefBeam] = []
    margin = float("inf")
    with torch.inference_mode():
        for _ in range(max_tokens):
            candidates = []
            for beam in live:
                logprobs = model(torch.tensor([beam.tokens])).logits[0, -1].log_softmax(-1)
                values, ids = logprobs.topk(2 * beam_width)
                for value, token in zip(values.tolist(), ids.tolist(), strict=True):
                    candidate = RefBeam([*beam.tokens, token], beam.cum_logprob + value, False)
                    if token == eos_id:
                        completed.append(candidate._replace(ended_by_eos=True))
                    else:
                        candidates.append(candidate)
            candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
            if len(candidates) > beam_width:
                kept, dropped = candidates[beam_width - 1], candidates[beam_width]
                margin = min(margin, kept.cum_logprob - dropped.cum_logprob)
            live = candidates[:beam_width]
    ranked = sorted([*completed, *live], key=lambda b: b.score(length_penalty), reverse=True)
    for better, worse in zip(ranked[:beam_width], ranked[1 : beam_width + 1], strict=False):
        margin = min(margin, better.score(length_penalty) - worse.score(length_penalty))
    return ranked[:beam_width], margin


def hf_logprob_sum(model: PreTrainedModel, tokens: list[int], num_prompt_tokens: int) -> float:
    """The raw log-probability of ``tokens[num_prompt_tokens:]`` given what precedes each."""
    with torch.inference_mode():
        logprobs = model(torch.tensor([tokens])).logits[0].log_softmax(-1)  # [len, vocab]
    return sum(
        logprobs[position - 1, tokens[position]].item()
        for position in range(num_prompt_tokens, len(tokens))
    )


# --- end to end -----------------------------------------------------------------------------


def test_beam_width_one_is_greedy_generate(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    expected = llm.generate([*PROMPTS, "The quick brown fox"], greedy)
    outputs = llm.beam_search(
        [*PROMPTS, {"prompt": "The quick brown fox"}],
        BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True),
    )
    assert len(outputs) == len(expected)
    for output, want in zip(outputs, expected, strict=True):
        (sequence,) = output.sequences
        assert sequence.tokens == [*want.prompt_token_ids, *want.token_ids]
        assert sequence.output_token_ids == want.token_ids
        assert sequence.cum_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-5)
        assert sequence.finish_reason is FinishReason.LENGTH
        assert sequence.stop_reason is None


def test_use_tqdm_counts_the_rounds(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    updates: list[int] = []

    class Bar:
        def __init__(self, **kwargs: object) -> None:
            assert kwargs["total"] == 5 and kwargs["desc"] == "Beam search"

        def update(self, n: int) -> None:
            updates.append(n)

        def close(self) -> None:
            updates.append(0)

    llm.beam_search(
        PROMPTS, BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True), use_tqdm=Bar
    )
    assert updates == [1, 1, 1, 1, 1, 0]  # a round a token, then closed
    llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2), use_tqdm=True)
    assert "Beam search" in capsys.readouterr().err
    llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2))  # vLLM's default: none
    assert "Beam search" not in capsys.readouterr().err


@pytest.mark.parametrize("beam_width", [3, 4])
def test_matches_a_reference_beam_search_over_hugging_face(
    llm: LLM,
    hf_model: PreTrainedModel,
    eos_id: int,
    eos_prompt: list[int],
    beam_width: int,
) -> None:
    """Sequences, their order, cum_logprobs and finish reasons; the EOS prompt has a beam
    completed by EOS at the first step, which outranks the longer ones."""
    prompts = [*PROMPTS, eos_prompt]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=4)
    outputs = llm.beam_search(prompts, params)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected, margin = reference_beam_search(hf_model, prompt, beam_width, 4, eos_id)
        # The premise of comparing choices: no cut closer than the two computations' rounding.
        assert margin > 10 * TOLERANCE, f"prompt {prompt}: a near-tie of {margin}"
        assert [s.tokens for s in output.sequences] == [b.tokens for b in expected]
        for sequence, beam in zip(output.sequences, expected, strict=True):
            assert sequence.cum_logprob == pytest.approx(beam.cum_logprob, abs=TOLERANCE)
            stop = FinishReason.STOP if beam.ended_by_eos else FinishReason.LENGTH
            assert sequence.finish_reason is stop
            assert sequence.stop_reason == (eos_id if beam.ended_by_eos else None)
            assert len(sequence.logprobs) == len(sequence.tokens) - len(prompt)
            for step, token in zip(sequence.logprobs, sequence.output_token_ids, strict=True):
                assert 2 * beam_width <= len(step) <= 2 * beam_width + 1 and token in step
            chosen = zip(sequence.logprobs, sequence.output_token_ids, strict=True)
            assert sequence.cum_logprob == pytest.approx(sum(s[t].logprob for s, t in chosen))
    first_of_eos_prompt = outputs[-1].sequences[0]
    assert first_of_eos_prompt.tokens == [*eos_prompt, eos_id]
    assert first_of_eos_prompt.finish_reason is FinishReason.STOP
    assert llm.engine.stats().num_blocks_used == 0


def test_eos_completes_a_beam_unless_ignore_eos(
    llm: LLM, eos_id: int, eos_prompt: list[int]
) -> None:
    (stopped,) = llm.beam_search([eos_prompt], BeamSearchParams(beam_width=2, max_tokens=3))
    by_eos = [s for s in stopped.sequences if s.finish_reason is FinishReason.STOP]
    assert by_eos and all(s.output_token_ids == [eos_id] for s in by_eos)
    (ignored,) = llm.beam_search(
        [eos_prompt], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    )
    assert all(s.finish_reason is FinishReason.LENGTH for s in ignored.sequences)
    assert all(len(s.output_token_ids) == 3 for s in ignored.sequences)
    # EOS, the most likely first token, is just a token now: the best beam goes on after it.
    assert ignored.sequences[0].output_token_ids[0] == eos_id


def test_length_penalty_orders_the_returned_sequences_by_score(
    llm: LLM, eos_id: int, eos_prompt: list[int]
) -> None:
    firsts = {}
    for length_penalty in (0.0, 1.0, 30.0):
        params = BeamSearchParams(beam_width=4, max_tokens=4, length_penalty=length_penalty)
        (output,) = llm.beam_search([eos_prompt], params)
        scores = [s.score(length_penalty) for s in output.sequences]
        assert scores == sorted(scores, reverse=True)
        firsts[length_penalty] = output.sequences[0]
    # By cum_logprob alone (0.0) the EOS beam leads: its one token is the first step's most
    # likely. A strong penalty (30.0) divides the longer beams' cum_logprobs by far more.
    assert firsts[0.0].output_token_ids == [eos_id]
    assert firsts[30.0].finish_reason is FinishReason.LENGTH
    assert len(firsts[30.0].output_token_ids) == 4


def test_scores_are_raw_logprobs_whatever_the_temperature(
    llm: LLM, hf_model: PreTrainedModel
) -> None:
    """A temperature changes the sampled candidate, not the logprobs a beam sums."""
    params = BeamSearchParams(beam_width=2, max_tokens=4, temperature=2.0, ignore_eos=True)
    for prompt, output in zip(PROMPTS, llm.beam_search(PROMPTS, params), strict=True):
        assert len(output.sequences) == 2
        for sequence in output.sequences:
            expected = hf_logprob_sum(hf_model, sequence.tokens, len(prompt))
            assert sequence.cum_logprob == pytest.approx(expected, abs=TOLERANCE)


def test_the_prefix_cache_serves_the_blocks_beams_share(llm: LLM) -> None:
    prompt = list(range(100, 120))  # one full block of 16 and 4 more tokens
    before = llm.engine.stats().prefix_cache_hit_tokens
    llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3))
    # Rounds 2 and 3: two beams each, each finding at least the prompt's full block cached.
    assert llm.engine.stats().prefix_cache_hit_tokens - before >= 2 * 2 * 16
    assert llm.engine.stats().num_blocks_used == 0


def test_text_decodes_prompt_and_output(llm: LLM) -> None:
    assert llm.tokenizer is not None
    prompt = "The quick brown fox"
    (output,) = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=3))
    prompt_ids = llm.tokenizer.encode(prompt).ids
    for sequence in output.sequences:
        assert sequence.tokens[: len(prompt_ids)] == prompt_ids
        assert sequence.text == llm.tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        assert sequence.text.startswith(prompt)


def test_without_a_tokenizer_there_is_no_text(tiny_llama_dir: Path) -> None:
    llm = small_llm(tiny_llama_dir, skip_tokenizer_init=True)
    (output,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=2))
    assert [s.text for s in output.sequences] == [None, None]


def test_bad_prompts_are_refused_and_leave_nothing_queued(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    assert llm.beam_search([], params) == []
    too_long = list(range(5, 5 + 65))  # max_model_len is 64
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.beam_search([PROMPTS[0], too_long], params)
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        llm.beam_search([[]], params)
    with pytest.raises(ValueError, match="keys"):
        llm.beam_search([{"prompt": "x", "images": []}], params)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="params must be BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams())  # type: ignore[arg-type]
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_blocks_used == 0


# --- the search's rules, through its seam ---------------------------------------------------

EOS = 2


class FakeEngine:
    """``next_logprobs`` from a table: each token list's next-token logprobs (the sampled token
    and the top-n together, as the engine's). Records each round's rows."""

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]]) -> None:
        self.table = table
        self.rounds: list[list[list[int]]] = []

    def __call__(
        self, token_ids: list[list[int]], params: SamplingParams
    ) -> list[dict[int, Logprob]]:
        assert params.max_tokens == 1 and params.logprobs is not None
        self.rounds.append(token_ids)
        return [
            {token: Logprob(value) for token, value in self.table[tuple(tokens)].items()}
            for tokens in token_ids
        ]


def search(
    engine: FakeEngine,
    prompts: Sequence[Sequence[int]],
    params: BeamSearchParams,
    max_model_len: int = 100,
) -> list[BeamSearchOutput]:
    return beam_search(
        prompts,
        params,
        engine,
        eos_token_ids={EOS},
        vocab_size=1000,
        max_model_len=max_model_len,
        decode=lambda ids: " ".join(map(str, ids)),
    )


def tokens(output: BeamSearchOutput) -> list[list[int]]:
    return [sequence.tokens for sequence in output.sequences]


SHORT_OR_LONG = {
    # After the prompt [10]: EOS (a short, finished beam) or 20, more likely.
    (10,): {EOS: -1.0, 20: -0.5},
    (10, 20): {21: -0.9, 22: -3.0},
}


@pytest.mark.parametrize(
    ("length_penalty", "first"),
    [
        (0.0, [10, EOS]),  # by cum_logprob: -1.0 beats -1.4
        (1.0, [10, 20, 21]),  # -1.0 / 1 loses to -1.4 / 3 (EOS is not counted)
    ],
)
def test_length_penalty_ranks_by_cum_logprob_over_length(
    length_penalty: float, first: list[int]
) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=length_penalty)
    (output,) = search(FakeEngine(SHORT_OR_LONG), [[10]], params)
    assert tokens(output)[0] == first
    assert sorted(tokens(output)) == [[10, EOS], [10, 20, 21]]
    ended = {tuple(s.tokens): s for s in output.sequences}
    eos_beam, long_beam = ended[(10, EOS)], ended[(10, 20, 21)]
    assert (eos_beam.finish_reason, eos_beam.stop_reason) == (FinishReason.STOP, EOS)
    assert (long_beam.finish_reason, long_beam.stop_reason) == (FinishReason.LENGTH, None)
    assert long_beam.cum_logprob == pytest.approx(-1.4)
    assert long_beam.score(1.0) == pytest.approx(-1.4 / 3)
    assert eos_beam.score(1.0) == pytest.approx(-1.0)
    assert eos_beam.text == "10"  # the EOS that completed it is left out
    assert long_beam.text == "10 20 21"


def test_eos_candidates_complete_whatever_their_rank_and_the_rest_are_pruned() -> None:
    table = {
        (10,): {30: -0.1, 31: -0.2, 32: -0.3, EOS: -5.0},
        (10, 30): {40: -0.1},
        (10, 31): {41: -0.1},
    }
    engine = FakeEngine(table)
    (output,) = search(engine, [[10]], BeamSearchParams(beam_width=2, max_tokens=2))
    # EOS ranked last of four, yet completed; 32 was the third live candidate: dropped.
    assert tokens(output) == [[10, 30, 40], [10, 31, 41]]
    assert engine.rounds == [[[10]], [[10, 30], [10, 31]]]
    (wider,) = search(FakeEngine(table), [[10]], BeamSearchParams(beam_width=3, max_tokens=1))
    assert tokens(wider) == [[10, 30], [10, 31], [10, 32]]  # the EOS beam ranks below them
    (widest,) = search(FakeEngine(table), [[10]], BeamSearchParams(beam_width=4, max_tokens=1))
    assert tokens(widest)[-1] == [10, EOS] and widest.sequences[-1].text == "10"


def test_ignore_eos_keeps_eos_beams_live() -> None:
    table = {(10,): {EOS: -0.1, 30: -0.2}, (10, EOS): {40: -0.1}, (10, 30): {41: -0.1}}
    params = BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True)
    (output,) = search(FakeEngine(table), [[10]], params)
    assert tokens(output) == [[10, EOS, 40], [10, 30, 41]]
    assert all(s.finish_reason is FinishReason.LENGTH for s in output.sequences)
    assert output.sequences[0].text == "10 2 40"


def test_a_prompt_whose_candidates_all_end_stops_searching() -> None:
    table = {(10,): {EOS: -0.5}, (20,): {21: -0.1}, (20, 21): {22: -0.1}, (20, 21, 22): {23: -0.1}}
    engine = FakeEngine(table)
    short, long = search(engine, [[10], [20]], BeamSearchParams(beam_width=1, max_tokens=3))
    assert tokens(short) == [[10, EOS]]
    assert tokens(long) == [[20, 21, 22, 23]]
    # One round per token, every prompt's live beams in it.
    assert engine.rounds == [[[10], [20]], [[20, 21]], [[20, 21, 22]]]


def test_max_model_len_ends_the_beams_with_length() -> None:
    table = {(10, 11): {12: -0.1}, (10, 11, 12): {13: -0.1}}
    engine = FakeEngine(table)
    params = BeamSearchParams(beam_width=1, max_tokens=10)
    (output,) = search(engine, [[10, 11]], params, max_model_len=3)
    assert tokens(output) == [[10, 11, 12]]
    assert output.sequences[0].finish_reason is FinishReason.LENGTH
    assert len(engine.rounds) == 1
    # A prompt of max_model_len tokens still gets one, as generate gives it.
    (full,) = search(FakeEngine(table), [[10, 11, 12]], params, max_model_len=3)
    assert tokens(full) == [[10, 11, 12, 13]]


def test_each_round_asks_for_twice_the_beam_width_within_the_vocabulary() -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=1, temperature=0.5, ignore_eos=True)
    round_params = params.round_params(vocab_size=1000)
    assert (round_params.max_tokens, round_params.logprobs) == (1, 6)
    assert (round_params.temperature, round_params.ignore_eos) == (0.5, True)
    assert params.round_params(vocab_size=4).logprobs == 4


def test_sequence_score_and_output_tokens() -> None:
    live = BeamSearchSequence(
        tokens=[1, 2, 3, 4], logprobs=[{3: -1.0}, {4: -1.0}], cum_logprob=-2.0
    )
    assert live.output_token_ids == [3, 4]
    assert live.score(1.0) == pytest.approx(-0.5)
    assert live.score(0.0) == pytest.approx(-2.0)
    assert live.score(2.0) == pytest.approx(-2.0 / 16)


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("beam_width", {"beam_width": 0}),
        ("beam_width", {"beam_width": MAX_BEAM_WIDTH + 1}),
        ("beam_width", {"beam_width": 2.0}),
        ("beam_width", {"beam_width": True}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": "8"}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": float("inf")}),
        ("length_penalty", {"length_penalty": float("inf")}),
        ("length_penalty", {"length_penalty": "1"}),
        ("ignore_eos", {"ignore_eos": 1}),
        ("include_stop_str_in_output", {"include_stop_str_in_output": "yes"}),
    ],
)
def test_bad_params_are_refused_naming_the_field(field: str, kwargs: dict[str, object]) -> None:
    settings: dict[str, object] = {"beam_width": 2, "max_tokens": 8} | kwargs
    with pytest.raises(SamplingParamError) as caught:
        BeamSearchParams(**settings)  # type: ignore[arg-type]
    assert caught.value.param == field
    assert str(caught.value).startswith(field)
