"""Speculative decoding through the engine (tiny model, CPU): the tokens a greedy request gets
are those it gets without speculation, whatever its sampling options; kept proposals come out
as several tokens of one step; random requests stay reproducible; constrained ones never
speculate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.sampler import SampleResult, SamplingMetadata
from services.engine.scheduler import SchedulerOutput
from services.types import StructuredOutputsParams
from support.small_llm import small_llm

SPECULATIVE = {"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Repeated short cycles: the tiny model's greedy text continues several, so proposals are kept.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11] * 3,
    list(range(20, 40)) * 2,
    [3, 4] * 15,
    [100, 200, 300] * 6,
]


@pytest.fixture(scope="module")
def base(tiny_llama_dir: Path) -> LLM:
    return small_llm(tiny_llama_dir, max_model_len=128)


@pytest.fixture(scope="module")
def spec(tiny_llama_dir: Path) -> LLM:
    return small_llm(tiny_llama_dir, max_model_len=128, speculative_config=SPECULATIVE)


def run(llm: LLM, params: SamplingParams) -> list[tuple[list[int], str | None]]:
    return [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        # Penalties see the proposals before each position as outputs.
        SamplingParams(
            max_tokens=40,
            temperature=0.0,
            ignore_eos=True,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
            presence_penalty=0.1,
        ),
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias={9: 0.5}),
    ],
    ids=["greedy", "penalties", "max_tokens", "logit_bias"],
)
def test_greedy_tokens_are_those_without_speculation(
    base: LLM, spec: LLM, params: SamplingParams
) -> None:
    before = spec.engine.stats()
    assert run(spec, params) == run(base, params)
    after = spec.engine.stats()
    if params.max_tokens > 3:
        assert after.num_accepted_tokens_total > before.num_accepted_tokens_total
    assert after.num_blocks_used == 0


def test_a_stop_token_among_the_kept_proposals_ends_the_request_there(base: LLM, spec: LLM) -> None:
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = run(base, free)
    # Stop each request on a token it repeats late in its output: by then proposals are kept.
    stops = sorted({tokens[-5] for tokens, _ in expected})
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=stops)
    got = run(spec, params)
    assert got == run(base, params)
    assert all(reason == "stop" and tokens[-1] in stops for tokens, reason in got)


def test_logprobs_are_those_without_speculation(base: LLM, spec: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    expected = base.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert len(have.logprobs) == len(want.logprobs) == 24
        for a, b in zip(have.logprobs, want.logprobs, strict=True):
            assert a.keys() == b.keys()
            for token_id in a:
                assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-4)
                assert a[token_id].rank == b[token_id].rank


def test_random_sampling_is_reproducible_and_keeps_proposals(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.5, top_k=3, ignore_eos=True)
    seeded = SamplingParams(max_tokens=40, temperature=0.5, top_k=3, ignore_eos=True, seed=11)
    runs = []
    for _ in range(2):
        llm = small_llm(tiny_llama_dir, max_model_len=128, seed=5, speculative_config=SPECULATIVE)
        runs.append((run(llm, params), run(llm, seeded)))
        assert llm.engine.stats().num_accepted_tokens_total > 0
    assert runs[0] == runs[1]
    for tokens, reason in runs[0][0] + runs[0][1]:
        assert len(tokens) == 40 and reason == "length"


def test_a_step_hands_out_every_token_it_kept(spec: LLM) -> None:
    engine = spec.engine
    prompt = PROMPTS[2]  # whose output soon repeats itself
    engine.add_request("r", prompt, SamplingParams(max_tokens=30, temperature=0.0))
    deltas: list[list[int]] = []
    while engine.has_unfinished_requests:
        for output in engine.step():
            deltas.append(output.new_token_ids)
    tokens = [token for delta in deltas for token in delta]
    assert len(tokens) == 30
    assert max(len(delta) for delta in deltas) > 1, "no step kept a proposal"
    assert len(deltas) < 30
    expected = spec.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False
    )
    assert tokens == expected[0].token_ids


def test_a_constrained_request_never_speculates(base: LLM, spec: LLM) -> None:
    choices = ["one two three one two three one two three", "four five"]
    params = SamplingParams(
        max_tokens=48, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    before = spec.engine.stats().num_draft_tokens_total
    prompt = "one two three one two three one two"
    got = spec.generate([prompt], params, use_tqdm=False)[0]
    assert spec.engine.stats().num_draft_tokens_total == before
    assert got.token_ids == base.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert got.text in choices


def test_each_verified_position_samples_after_the_proposals_before_it(
    spec: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What penalties, ``min_tokens`` and bad words see at each position of a verification:
    the request's outputs and the proposals before the position (the sampler's own tests cover
    what it does with them)."""
    engine = spec.engine
    seen: list[tuple[list[tuple[int, ...]], list[list[int]]]] = []
    sampler, schedule = engine.runner.sampler, engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        output = schedule()
        seen.append(([c.draft_token_ids for c in output.chunks], []))
        return output

    def recording_sampler(logits: torch.Tensor, metadata: SamplingMetadata) -> SampleResult:
        seen[-1][1].extend(list(rows) for rows in metadata.output_token_ids)
        return sampler(logits, metadata)

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    monkeypatch.setattr(engine.runner, "sampler", recording_sampler)
    outputs_before: list[list[int]] = []
    engine.add_request("r", PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.0))
    request = engine.scheduler.requests["r"]
    while engine.has_unfinished_requests:
        outputs_before.append(list(request.output_token_ids))
        engine.step()
    verified = 0
    for (drafts_of_chunks, rows), before in zip(seen, outputs_before, strict=True):
        (drafts,) = drafts_of_chunks
        if not before:
            continue  # the prompt's step
        assert rows == [before + list(drafts[:i]) for i in range(len(drafts) + 1)]
        verified += len(drafts)
    assert verified > 0


def test_no_proposals_while_the_batch_is_larger_than_disable_by_batch_size(
    tiny_llama_dir: Path,
) -> None:
    llm = small_llm(
        tiny_llama_dir,
        max_model_len=128,
        speculative_config={**SPECULATIVE, "disable_by_batch_size": 1},
    )
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    together = llm.generate(PROMPTS, params, use_tqdm=False)  # four running at once
    assert llm.engine.stats().num_draft_tokens_total == 0
    alone = llm.generate([PROMPTS[2]], params, use_tqdm=False)
    assert llm.engine.stats().num_accepted_tokens_total > 0
    assert alone[0].token_ids == together[2].token_ids


@pytest.mark.gpu
def test_on_a_gpu_greedy_tokens_are_those_without_speculation(tiny_llama_dir: Path) -> None:
    """The Triton decode kernel takes the proposals' rows, and the decode graphs (on by default
    on CUDA) take up to max_num_seqs x (1 + num_speculative_tokens) of them."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = small_llm(tiny_llama_dir, max_model_len=128, device="cuda")
    spec = small_llm(
        tiny_llama_dir, max_model_len=128, device="cuda", speculative_config=SPECULATIVE
    )
    assert spec.engine.runner.static_decode is not None
    assert run(spec, params) == run(plain, params)
    assert spec.engine.stats().num_accepted_tokens_total > 0
