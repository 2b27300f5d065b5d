"""Beam search over the engine, as vLLM's ``LLM.beam_search`` and its OpenAI server's
``use_beam_search``: parameters, results, the search (torch-free: the gateway runs it too).

The engine samples one token a request; beam search is built on top of it from rounds of
one-token requests. The life cycle of a beam (each prompt searches on its own; the beams of every
prompt share each engine round):

1. LIVE: at first the prompt alone. Each round every live beam is one engine request of its
   tokens so far (prompt + generated) with ``max_tokens=1`` and ``logprobs=2 * beam_width``
   (Hugging Face's and vLLM's count: enough that ``beam_width`` candidates remain when some end
   in EOS). The prefix cache serves the blocks the beams share, so a round computes little more
   than each beam's newest token.
2. CANDIDATE: a live beam extended by one token of what the round returned: the sampled token
   (the argmax at temperature 0, a draw otherwise) and the ``2 * beam_width`` most likely ones,
   each with its log-probability added to the beam's ``cum_logprob``.
3. COMPLETED with ``stop``: a candidate whose token is EOS (unless ``ignore_eos``), whatever its
   rank among the round's candidates. Of the others, the ``beam_width`` best are the next
   round's live beams and the rest are dropped.
4. COMPLETED with ``length``: the live beams once they hold ``max_tokens`` generated tokens (or
   reach ``max_model_len``, where the engine would stop a request). The search of a prompt ends
   when it has no live beams left.
5. RANKED: the completed beams by ``BeamSearchSequence.score``; the best ``beam_width`` are the
   prompt's ``BeamSearchOutput``.

The log-probabilities are the engine's logprobs: ``log_softmax`` of the model's raw logits
(``services.engine.sampler``), before temperature, so ``temperature`` changes which token is
sampled (one more candidate per beam) but never a candidate's score.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from services.types import FinishReason, SamplingParamError, SamplingParams
from services.types.logprob import Logprob
from services.types.sampling_params import MAX_N, check_float, check_int

logger = logging.getLogger(__name__)

MAX_BEAM_WIDTH = MAX_N
"""Most beams one prompt may keep: each is a request of its own each round, as each of
``SamplingParams.n``'s samples is."""

NextTokenLogprobs = Callable[[list[list[int]], SamplingParams], list[dict[int, Logprob]]]
"""One engine round: for each token list (prompt + generated), its next token's logprobs under
the given params ({sampled id: ``Logprob``, plus the top-n ids}). ``LLM.beam_search`` runs it as one
``LLM.generate`` call; tests give synthetic distributions."""

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``. Every check raises ``SamplingParamError`` (a ``ValueError``)
    naming the offending field."""

    beam_width: int
    """Beams kept per prompt each round, and sequences returned per prompt; in [1,
    ``MAX_BEAM_WIDTH``]."""
    max_tokens: int
    """Most tokens a beam generates (and engine rounds a search runs); >= 1."""
    ignore_eos: bool = False
    """EOS is a token like any other: every beam runs to ``max_tokens`` (or ``max_model_len``)."""
    temperature: float = 0.0
    """The temperature of each round's sample (one candidate per beam besides the most likely
    tokens); 0: greedy. Scores use the raw logprobs whatever the temperature."""
    length_penalty: float = 1.0
    """A beam's score is ``cum_logprob / num_tokens ** length_penalty`` (``score``): above 0
    favours longer sequences, 0 ranks by ``cum_logprob`` alone."""
    include_stop_str_in_output: bool = False
    """Keep the EOS that completed a beam in its ``text`` (it is in ``tokens`` either way); the
    text skips special tokens, so this shows only an EOS the tokenizer does not mark special."""

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, minimum=1, maximum=MAX_BEAM_WIDTH)
        check_int("max_tokens", self.max_tokens, minimum=1)
        _check_bool("ignore_eos", self.ignore_eos)
        check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamError(
                "temperature", f"temperature must be >= 0, got {self.temperature}"
            )
        check_float("length_penalty", self.length_penalty)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)

    def round_params(self, vocab_size: int) -> SamplingParams:
        """What each live beam's request of a round asks the engine for."""
        return SamplingParams(
            max_tokens=1,
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
            # At most the vocabulary, which the engine refuses to exceed.
            logprobs=min(2 * self.beam_width, vocab_size),
            detokenize=False,  # the search reads token ids; only its results are decoded
        )


@dataclass(frozen=True)
class BeamSearchSequence:
    """One beam, as vLLM's ``BeamSearchSequence``."""

    tokens: list[int]
    """Prompt + generated token ids (vLLM's), the EOS that completed it included."""
    logprobs: list[dict[int, Logprob]]
    """Per generated token: what its round returned, {sampled id: ``Logprob``, plus the top-n
    ids} (vLLM's)."""
    cum_logprob: float = 0.0
    """The sum of the generated tokens' logprobs (an EOS that completed it included)."""
    text: str | None = None
    """``tokens`` decoded (the prompt's text too, as vLLM's), special tokens skipped, the EOS
    that completed it left out unless ``include_stop_str_in_output``; None without a tokenizer
    (and while the search runs)."""
    finish_reason: FinishReason | None = None
    """``stop`` for EOS, ``length`` for ``max_tokens`` or ``max_model_len``; None while live."""
    stop_reason: int | None = None
    """With ``stop``: the EOS id that completed it (vLLM's beam search reports it)."""

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens alone (one per entry of ``logprobs``)."""
        return self.tokens[len(self.tokens) - len(self.logprobs) :]

    def score(self, length_penalty: float) -> float:
        """How beams are ranked: ``cum_logprob / num_tokens ** length_penalty``, where
        ``num_tokens`` counts the prompt and the generated tokens but not the EOS that completed
        the beam (vLLM's ``get_beam_search_score``, after Hugging Face's)."""
        num_tokens = len(self.tokens) - (self.finish_reason is FinishReason.STOP)
        return self.cum_logprob / math.pow(num_tokens, length_penalty)


@dataclass(frozen=True)
class BeamSearchOutput:
    """One prompt's result, as vLLM's: at most ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _PromptSearch:
    """One prompt's beams while the search runs (vLLM's ``BeamSearchInstance``)."""

    max_new_tokens: int
    """``max_tokens``, or fewer where ``max_model_len`` comes first."""
    live: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """One search over every prompt at once, driven a round at a time, so that the offline
    ``LLM`` (``beam_search``) and the gateway (each round's requests sent to the nodes
    concurrently) run the same search: ``beams()`` are this round's live beams' token lists
    (none once the search is over), ``advance`` takes their next tokens' logprobs in that order,
    ``results`` ranks what completed."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        params: BeamSearchParams,
        *,
        eos_token_ids: Collection[int],
        vocab_size: int,
        max_model_len: int,
    ) -> None:
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        self.params = params
        self.round_params = params.round_params(vocab_size)
        """What each live beam's request of a round asks for."""
        self._eos_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._searches = [
            _PromptSearch(
                # A prompt of max_model_len tokens still gets one, as LLM.generate gives it.
                max_new_tokens=min(params.max_tokens, max(max_model_len - len(prompt), 1)),
                live=[BeamSearchSequence(tokens=[int(t) for t in prompt], logprobs=[])],
            )
            for prompt in prompts
        ]

    def beams(self) -> list[list[int]]:
        """This round's live beams' tokens (prompt + generated), every prompt's in turn."""
        return [beam.tokens for search in self._searches for beam in search.live]

    def advance(self, rows: Sequence[dict[int, Logprob]]) -> None:
        """One round: ``rows`` holds each live beam's next-token logprobs ({sampled id:
        ``Logprob``, plus the top ids}), in ``beams()``'s order."""
        num_live = sum(len(search.live) for search in self._searches)
        if len(rows) != num_live:
            raise ValueError(f"{len(rows)} logprob rows for {num_live} beams")
        returned = iter(rows)
        for search in self._searches:
            candidates = []
            for beam in search.live:
                step = next(returned)
                for token_id, logprob in step.items():
                    candidate = BeamSearchSequence(
                        tokens=[*beam.tokens, token_id],
                        logprobs=[*beam.logprobs, step],
                        cum_logprob=beam.cum_logprob + logprob.logprob,
                    )
                    if token_id in self._eos_ids:
                        search.completed.append(
                            replace(
                                candidate, finish_reason=FinishReason.STOP, stop_reason=token_id
                            )
                        )
                    else:
                        candidates.append(candidate)
            # A prompt's live beams are all of one length, so length_penalty cannot reorder them.
            candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
            search.live = candidates[: self.params.beam_width]
            if search.live and len(search.live[0].logprobs) >= search.max_new_tokens:
                search.completed.extend(
                    replace(beam, finish_reason=FinishReason.LENGTH) for beam in search.live
                )
                search.live = []

    def results(self, decode: Decode | None = None) -> list[BeamSearchOutput]:
        """One ``BeamSearchOutput`` per prompt, in their order; ``decode`` gives each returned
        sequence its ``text`` (None: no text)."""
        return [_ranked(search.completed, self.params, decode) for search in self._searches]


def beam_search(
    prompts: Sequence[Sequence[int]],
    params: BeamSearchParams,
    next_logprobs: NextTokenLogprobs,
    *,
    eos_token_ids: Collection[int],
    vocab_size: int,
    max_model_len: int,
    decode: Decode | None = None,
) -> list[BeamSearchOutput]:
    """Search every prompt (token ids) at once, one ``next_logprobs`` round per generated token:
    one ``BeamSearchOutput`` per prompt, in their order. ``decode`` gives each returned
    sequence its ``text`` (None: no text)."""
    search = BeamSearch(
        prompts,
        params,
        eos_token_ids=eos_token_ids,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
    )
    # Each round ends at least one token of every live beam: max_tokens rounds at most.
    while beams := search.beams():
        rows = next_logprobs(beams, search.round_params)
        assert len(rows) == len(beams), f"{len(rows)} logprob rows for {len(beams)} beams"
        search.advance(rows)
    return search.results(decode)


def _ranked(
    completed: list[BeamSearchSequence], params: BeamSearchParams, decode: Decode | None
) -> BeamSearchOutput:
    """The best ``beam_width`` completed beams, best first (a stable sort: ties keep the order
    they completed in), with their text."""
    best = sorted(completed, key=lambda beam: beam.score(params.length_penalty), reverse=True)
    sequences = []
    for beam in best[: params.beam_width]:
        text = None
        if decode is not None:
            tokens = beam.tokens
            if beam.finish_reason is FinishReason.STOP and not params.include_stop_str_in_output:
                tokens = tokens[:-1]
            text = decode(tokens)
        sequences.append(replace(beam, text=text))
    return BeamSearchOutput(sequences=sequences)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SamplingParamError(name, f"{name} must be a bool, got {value!r}")
