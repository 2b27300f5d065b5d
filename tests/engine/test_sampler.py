"""Sampler tests: each outcome is checked against a direct computation from the raw logits.

Those of seeds, penalties and the logits steps (logit bias, grammar bitmask, ...) run on each
device: on a GPU the logits, the per-request generators and the masks built for them live there.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from services.engine.sampler import Sampler, SamplingMetadata, process_logits
from services.models.layer_ops import LayerOps
from services.types import SamplingParams

EOS_TOKEN_ID = 2
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_sampler() -> Sampler:
    return Sampler(eos_token_ids=[EOS_TOKEN_ID])


def make_metadata(
    params: Sequence[SamplingParams],
    *,
    prompt_token_ids: Sequence[list[int]] | None = None,
    output_token_ids: Sequence[list[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    num_rows = len(params)
    return SamplingMetadata(
        params=list(params),
        prompt_token_ids=list(prompt_token_ids or [[] for _ in range(num_rows)]),
        output_token_ids=list(output_token_ids or [[] for _ in range(num_rows)]),
        generators=list(generators or [None] * num_rows),
    )


def make_logits(
    num_rows: int, vocab_size: int, *, seed: int, scale: float = 2.0, device: str = "cpu"
) -> torch.Tensor:
    """The same values on every device: drawn on the CPU, then moved."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, vocab_size, generator=generator) * scale).to(device)


def make_generator(seed: int, device: str = "cpu") -> torch.Generator:
    """A request's own generator, on the logits' device as the model runner makes it."""
    return torch.Generator(device=device).manual_seed(seed)


def sample_many(
    row_logits: torch.Tensor, params: SamplingParams, num_draws: int, *, seed: int = 0
) -> Counter[int]:
    """Draw ``num_draws`` tokens from one row of logits ``[vocab_size]`` in one batched call."""
    torch.manual_seed(seed)
    logits = row_logits.expand(num_draws, -1)
    result = make_sampler()(logits, make_metadata([params] * num_draws))
    return Counter(result.token_ids)


def allowed_tokens(
    row_logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """The tokens top-k, then top-p, then min-p leave, computed one token at a time in float64."""
    scaled = [x / temperature for x in row_logits.double().tolist()]
    order = sorted(range(len(scaled)), key=lambda i: scaled[i], reverse=True)
    if top_k > 0:
        order = order[:top_k]
    total = sum(math.exp(scaled[i]) for i in order)
    nucleus, mass = [], 0.0
    for i in order:
        nucleus.append(i)
        mass += math.exp(scaled[i]) / total
        if mass >= top_p:
            break
    max_prob = math.exp(scaled[nucleus[0]])
    return {i for i in nucleus if math.exp(scaled[i]) >= min_p * max_prob}


def test_greedy_is_argmax_and_input_is_untouched() -> None:
    logits = make_logits(8, 1000, seed=0).to(torch.bfloat16)
    original = logits.clone()
    result = make_sampler()(logits, make_metadata([SamplingParams(temperature=0.0)] * 8))
    assert result.token_ids == logits.float().argmax(dim=-1).tolist()
    assert all(type(token_id) is int for token_id in result.token_ids)
    assert result.logprobs == [None] * 8
    assert torch.equal(logits, original)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_torchs_argmax_on_ties_nan_and_inf(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (40, 500), generator=generator).to(dtype)  # ties everywhere
    logits[3, 17] = float("nan")
    logits[4, [9, 300]] = float("nan")  # the first NaN wins
    logits[5] = float("-inf")
    logits[6, 7:] = float("inf")
    greedy_argmax = LayerOps().greedy_argmax
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
    assert greedy_argmax(logits)[4] == 9 and greedy_argmax(logits)[5] == 0


def test_greedy_rows_take_the_injected_argmax_on_the_raw_logits_when_nothing_applies() -> None:
    logits = make_logits(4, 50, seed=3, scale=1.0).to(torch.bfloat16)
    seen: list[torch.Tensor] = []

    def last_token(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows)
        return torch.full((rows.shape[0],), rows.shape[1] - 1, dtype=torch.int64)

    sampler = Sampler([EOS_TOKEN_ID], last_token)
    result = sampler(logits, make_metadata([SamplingParams(temperature=0.0)] * 4))
    assert result.token_ids == [49] * 4
    assert seen[-1] is logits  # no float32 copy: its argmax would be the same
    penalised = [SamplingParams(temperature=0.0, presence_penalty=0.5)] * 4
    sampler(logits, make_metadata(penalised, output_token_ids=[[1]] * 4))
    assert seen[-1].dtype == torch.float32  # the processed copy
    assert torch.equal(seen[-1][:, 1], logits[:, 1].float() - 0.5)


def test_top_k_one_at_temperature_one_is_greedy() -> None:
    logits = make_logits(16, 500, seed=1, scale=0.5)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(16)]
    generators = [make_generator(i) for i in range(16)]
    result = make_sampler()(logits, make_metadata(params, generators=generators))
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def run_seeded(seed: int, num_steps: int) -> list[int]:
    sampler = make_sampler()
    params = SamplingParams(temperature=1.0, seed=seed)
    generator = make_generator(seed)
    tokens = []
    for step in range(num_steps):
        # Nearly flat, so two different seeds agreeing on every step is practically impossible.
        logits = make_logits(1, 1000, seed=100 + step, scale=0.1)
        result = sampler(logits, make_metadata([params], generators=[generator]))
        tokens.extend(result.token_ids)
    return tokens


def test_same_seed_gives_same_tokens_and_other_seeds_differ() -> None:
    first = run_seeded(seed=42, num_steps=50)
    torch.manual_seed(12345)  # the global generator must play no part in seeded rows
    assert run_seeded(seed=42, num_steps=50) == first
    assert run_seeded(seed=43, num_steps=50) != first
    assert len(set(first)) > 25


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_does_not_depend_on_the_rest_of_the_batch(device: str) -> None:
    sampler = make_sampler()
    target = SamplingParams(temperature=0.8, seed=7)
    neighbours = [
        SamplingParams(temperature=1.3, top_k=5, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, seed=8, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    alone_generator, batched_generator = make_generator(7, device), make_generator(7, device)
    neighbour_generator = make_generator(8, device)
    for step in range(20):
        logits = make_logits(4, 300, seed=200 + step, scale=0.3, device=device)
        alone = sampler(logits[2:3], make_metadata([target], generators=[alone_generator]))
        batched = sampler(
            logits,
            make_metadata(
                [neighbours[0], neighbours[1], target, neighbours[2]],
                output_token_ids=[[1, 2], [], [], [3, 3, 4]],
                generators=[None, None, batched_generator, neighbour_generator],
            ),
        )
        assert batched.token_ids[2] == alone.token_ids[0], f"step {step}"


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.5, 5, 1.0, 0.0),
        (0.9, -1, 0.6, 0.0),
        (1.0, -1, 1.0, 0.1),
        (1.2, 8, 0.7, 0.05),
    ],
)
def test_truncation_samples_exactly_the_allowed_tokens(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    row_logits = make_logits(1, 100, seed=3, scale=1.0)[0]
    expected = allowed_tokens(
        row_logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    assert 2 <= len(expected) < 100, "a degenerate case would not test truncation"
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    counts = sample_many(row_logits, params, num_draws=4000)
    # Every allowed token has probability >= 1% here, so 4000 draws hit each of them.
    assert set(counts) == expected


def test_never_samples_a_masked_token() -> None:
    logits = torch.full((1, 50), float("-inf"))
    logits[0, 17] = -30.0
    for params in [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.3, top_k=3, top_p=0.2, min_p=0.9),
        SamplingParams(temperature=0.0),
    ]:
        assert set(sample_many(logits[0], params, num_draws=2000)) == {17}


def reference_process(
    row_logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """Min-tokens masking and penalties for one row, one token at a time."""
    counts = Counter(output)
    processed = []
    for token_id, x in enumerate(row_logits):
        stop_ids = {EOS_TOKEN_ID, *params.stop_token_ids}
        if len(output) < params.min_tokens and token_id in stop_ids:
            x = float("-inf")
        if token_id in prompt or token_id in counts:
            r = params.repetition_penalty
            x = x / r if x > 0 else x * r
        x -= params.frequency_penalty * counts[token_id]
        x -= params.presence_penalty * (counts[token_id] > 0)
        processed.append(x)
    return processed


@pytest.mark.parametrize("device", DEVICES)
def test_process_logits_matches_direct_computation(device: str) -> None:
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.7, presence_penalty=0.4),
        SamplingParams(frequency_penalty=0.9, presence_penalty=-0.3),
        SamplingParams(),
        SamplingParams(min_tokens=4, stop_token_ids=[5], repetition_penalty=1.2),
        SamplingParams(min_tokens=2, stop_token_ids=[5], frequency_penalty=1.0),
    ]
    prompt_token_ids = [[1, 3, 3, 9], [0, 11], [4, 4], [1, 2, 3], [6, 7], [8]]
    output_token_ids = [[3, 12], [11, 11, 13], [5, 5, 5, 7], [1, 1], [6, 2], [10, 10, 4]]
    logits = make_logits(len(params), 16, seed=4, device=device)
    metadata = make_metadata(
        params, prompt_token_ids=prompt_token_ids, output_token_ids=output_token_ids
    )
    processed = process_logits(logits, metadata, [EOS_TOKEN_ID])
    assert processed.device == logits.device
    expected = torch.tensor(
        [
            reference_process(row, p, prompt, output)
            for row, p, prompt, output in zip(
                logits.tolist(), params, prompt_token_ids, output_token_ids, strict=True
            )
        ]
    )
    assert (logits > 0).any() and (logits < 0).any()
    torch.testing.assert_close(processed.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_change_the_greedy_choice(device: str) -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]] * 3, device=device)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),  # 3.0 / 1.5 = 2.0 < 2.5
        SamplingParams(temperature=0.0, frequency_penalty=0.3),  # 3.0 - 2 * 0.3 = 2.4 < 2.5
        SamplingParams(temperature=0.0, presence_penalty=0.3),  # 3.0 - 0.3 = 2.7 > 2.5
    ]
    metadata = make_metadata(
        params, prompt_token_ids=[[1], [], []], output_token_ids=[[], [1, 1], [1, 1]]
    )
    assert make_sampler()(logits, metadata).token_ids == [2, 2, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "step", ["min_tokens", "allowed", "bad_words", "logit_bias", "penalty", "grammar"]
)
def test_each_logits_step_alone_changes_an_all_greedy_batch(step: str, device: str) -> None:
    # Every row greedy: the sampler takes the raw logits' argmax unless a step applies, so a
    # step it failed to notice would leave token 1 (the raw maximum) chosen.
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]] * 2, device=device)
    params = SamplingParams(
        temperature=0.0,
        min_tokens=2 if step == "min_tokens" else 0,
        stop_token_ids=[1] if step == "min_tokens" else [],
        logit_bias={1: -1.0} if step == "logit_bias" else {},
        allowed_token_ids=(0, 2, 3) if step == "allowed" else (),
        bad_words_token_ids=((1,),) if step == "bad_words" else (),
        presence_penalty=1.0 if step == "penalty" else 0.0,
    )
    metadata = make_metadata([params, params], output_token_ids=[[1], [1]])
    if (
        step == "grammar"
    ):  # the first row may not take token 1: word 0, bits 0, 2, 3, on the CPU as matchers write it
        metadata = dataclasses.replace(
            metadata, grammar_bitmask=torch.tensor([[0b1101]], dtype=torch.int32), grammar_rows=(0,)
        )
    expected = process_logits(logits, metadata, [EOS_TOKEN_ID]).argmax(dim=-1).tolist()
    assert expected[0] != 1
    assert make_sampler()(logits, metadata).token_ids == expected


def test_allowed_token_ids_are_all_a_row_may_sample() -> None:
    # Token 1 is the most likely by far; rows limited to {3, 7} (given unsorted and repeated)
    # sample only those, greedy or random, beside a row without a limit.
    logits = torch.zeros(1, 10)
    logits[0, 1] = 10.0
    logits[0, 3] = 2.0
    limited = [SamplingParams(temperature=t, allowed_token_ids=[7, 3, 7]) for t in (0.0, 1.0)]
    assert limited[0].allowed_token_ids == (3, 7)
    free = SamplingParams(temperature=0.0)
    torch.manual_seed(0)
    metadata = make_metadata([limited[0], free] + [limited[1]] * 300)
    tokens = make_sampler()(logits.expand(302, -1), metadata).token_ids
    assert tokens[0] == 3  # the allowed maximum
    assert tokens[1] == 1  # no limit: untouched
    assert set(tokens[2:]) == {3, 7}  # both drawn (e^2 : 1), nothing else


def test_bad_words_forbid_the_token_that_would_complete_them() -> None:
    # Token 1 is the most likely, then 2. Bad words: [1] alone, and [5, 6, 2].
    logits = torch.zeros(1, 10)
    logits[0, 1] = 10.0
    logits[0, 2] = 9.0
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[5, 6, 2], [1]])
    outputs = [[], [6], [5, 6], [4, 5, 6], [5, 6, 7], [6, 5, 6, 0]]
    metadata = make_metadata([params] * len(outputs), output_token_ids=outputs)
    tokens = make_sampler()(logits.expand(len(outputs), -1), metadata).token_ids
    # A one-token word is never sampled; [5, 6, 2] only where the output ends with 5, 6.
    assert tokens == [2, 2, 0, 0, 2, 2]
    # Random rows too: with every other token at -inf only token 3 is left.
    logits = torch.full((1, 4), float("-inf"))
    logits[0, 1:] = 0.0
    params = SamplingParams(temperature=1.0, bad_words_token_ids=[[1], [9, 2]])
    metadata = make_metadata([params] * 50, output_token_ids=[[9]] * 50)
    assert set(make_sampler()(logits.expand(50, -1), metadata).token_ids) == {3}


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 10)
    logits[0, EOS_TOKEN_ID] = 20.0
    logits[0, 7] = 19.0
    logits[0, 4] = 18.0
    for ignore_eos in (False, True):
        for temperature in (0.0, 1.0):
            params = SamplingParams(
                temperature=temperature, min_tokens=3, stop_token_ids=[7], ignore_eos=ignore_eos
            )
            for num_output in range(5):
                torch.manual_seed(num_output)
                metadata = make_metadata([params] * 200, output_token_ids=[[0] * num_output] * 200)
                tokens = set(make_sampler()(logits.expand(200, -1), metadata).token_ids)
                if num_output < 3:
                    assert EOS_TOKEN_ID not in tokens and 7 not in tokens
                    if temperature == 0.0:
                        assert tokens == {4}
                else:
                    assert EOS_TOKEN_ID in tokens


def test_logprobs_are_raw_log_softmax_of_sampled_and_top_tokens() -> None:
    logits = make_logits(4, 200, seed=5).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=2.0, seed=1),
        SamplingParams(temperature=0.0, logprobs=0, frequency_penalty=2.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.5, top_k=50, logprobs=5),
    ]
    top = logits.float().argmax(dim=-1).tolist()
    metadata = make_metadata(
        params,
        prompt_token_ids=[[top[0]], [], [], []],
        output_token_ids=[[], [top[1]], [], []],
        generators=[make_generator(1), None, None, None],
    )
    result = make_sampler()(logits, metadata)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert result.logprobs[2] is None and result.ranks[2] is None
    for row, n in [(0, 3), (1, 0), (3, 5)]:
        entries = result.logprobs[row]
        assert entries is not None
        sampled = result.token_ids[row]
        top_ids = raw[row].topk(n).indices.tolist() if n else []
        assert set(entries) == {sampled, *top_ids}
        for token_id, logprob in entries.items():
            assert type(token_id) is int and type(logprob) is float
            assert logprob == pytest.approx(raw[row, token_id].item(), abs=1e-5)
        # vLLM's rank: 1 + the tokens with a greater raw logprob (bf16 logits tie often).
        assert result.ranks[row] == 1 + int((raw[row] > raw[row, sampled]).sum())
    # Penalties moved the greedy row off its raw argmax, so its logprob is not the top one.
    assert result.token_ids[1] != top[1]
    assert result.ranks[1] is not None and result.ranks[1] > 1


def chi_square(counts: Counter[int], probs: list[float], num_draws: int) -> float:
    return sum((counts[i] - num_draws * p) ** 2 / (num_draws * p) for i, p in enumerate(probs))


def test_temperature_sampling_frequencies_match_softmax() -> None:
    row_logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 1.5, -1.0])
    temperature, num_draws = 0.7, 20000
    probs = torch.softmax(row_logits.double() / temperature, dim=-1).tolist()
    unscaled_probs = torch.softmax(row_logits.double(), dim=-1).tolist()

    counts = sample_many(row_logits, SamplingParams(temperature=temperature), num_draws, seed=0)
    # 5 degrees of freedom: P(chi2 > 25) ~ 1e-4, while ignoring the temperature scores far higher.
    assert chi_square(counts, probs, num_draws) < 25
    assert chi_square(counts, unscaled_probs, num_draws) > 100

    # Seeded rows, each drawing from its own generator.
    num_seeded = 5000
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(num_seeded)]
    metadata = make_metadata(params, generators=[make_generator(i) for i in range(num_seeded)])
    result = make_sampler()(row_logits.expand(num_seeded, -1), metadata)
    assert chi_square(Counter(result.token_ids), probs, num_seeded) < 25


def test_metadata_must_cover_every_row() -> None:
    metadata = make_metadata([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="params has 2 rows, logits have 3"):
        make_sampler()(torch.zeros(3, 10), metadata)


def run_unseeded(shared_generator: torch.Generator, num_steps: int) -> list[int]:
    """Tokens of a batch of 4 rows without seeds of their own, over ``num_steps`` steps."""
    sampler = make_sampler()
    params = [SamplingParams(temperature=1.0)] * 3 + [SamplingParams(temperature=0.9, seed=5)]
    seeded = make_generator(5)
    tokens = []
    for step in range(num_steps):
        logits = make_logits(4, 1000, seed=300 + step, scale=0.1)  # nearly flat
        metadata = dataclasses.replace(
            make_metadata(params, generators=[None, None, None, seeded]),
            shared_generator=shared_generator,
        )
        tokens.extend(sampler(logits, metadata).token_ids)
    return tokens


def test_rows_without_a_seed_draw_from_the_shared_generator_only() -> None:
    global_state = torch.get_rng_state()
    first = run_unseeded(make_generator(11), num_steps=20)
    # The global generator plays no part, and is left as it was.
    assert torch.equal(torch.get_rng_state(), global_state)
    torch.manual_seed(999)
    assert run_unseeded(make_generator(11), num_steps=20) == first
    assert run_unseeded(make_generator(12), num_steps=20) != first
