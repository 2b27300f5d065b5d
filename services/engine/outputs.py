"""What the engine hands back: per-step deltas (``EngineCoreOutput``) and whole results."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.logprob import Logprob
from services.types import FinishReason


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """One request's progress in one step: the token it gained, and whether it is done."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason | None
    num_cached_tokens: int
    """Prompt tokens served by the prefix cache."""
    first_scheduled_time: float | None = None
    """time.monotonic() of the request's first scheduled step (None: never scheduled)."""
    new_logprob_ranks: list[int | None] | None = None
    """Beside ``new_logprobs``: each new token's rank in the vocabulary (None where not
    computed: a first token committed from the prefill node)."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With the request's first token, when it asked for them: ``Request.prompt_logprobs``."""
    prompt_logprob_ranks: list[int | None] | None = None
    """Beside ``prompt_logprobs``: ``Request.prompt_logprob_ranks``."""
    error: str | None = None
    """With finish reason ``error``: why (its grammar failed: ``Request.grammar_error``)."""
    embedding: list[float] | None = None
    """An embedding request's vector, with its one output (finish reason ``stop``)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence of a ``RequestOutput``, in vLLM's shape (``out.outputs[0].text``):
    the first a view of the output's own fields, the others (``SamplingParams.n`` > 1) those of
    the prompt's further samples."""

    index: int
    text: str | None
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    """vLLM's: per generated token, ``{sampled id: Logprob, plus the top-n ids}``."""
    finish_reason: FinishReason | None
    """A ``str`` enum: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``."""
    cumulative_logprob: float | None
    """The sum of the sampled tokens' logprobs; None unless logprobs were asked for."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it; None otherwise (EOS included)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A whole generation, as ``LLM.generate`` returns it: the generated sequence's fields on the
    output itself (``out.text``), and in vLLM's shape too (``out.outputs[0].text``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[dict[int, Logprob]] | None
    """Per generated token: {sampled id: ``Logprob``, plus the top-n ids}; None unless asked."""
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """vLLM's: per prompt token (the first None), {its id: ``Logprob`` (its ``rank`` in the
    whole vocabulary), plus the top-n ids}; None unless asked."""
    prompt: str | None = None
    """The prompt's text, when it was given as text."""
    text: str | None = None
    """``token_ids`` decoded, special tokens skipped, the stop token that ended it left out
    (``LLM.generate``); None where no tokenizer was loaded."""
    error: str | None = None
    """With finish reason ``error``: why (the request's grammar failed while it ran)."""
    stop_reason: str | int | None = None
    """With finish reason ``stop``: the ``SamplingParams.stop`` string or the
    ``stop_token_ids`` entry that ended it; None for EOS (vLLM's ``stop_reason``)."""
    more_outputs: list[CompletionOutput] = field(default_factory=list)
    """The prompt's other samples (``SamplingParams.n`` > 1), ``outputs`` 1 .. n - 1."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's ``RequestOutput.outputs``: the generated sequences, this output's own first."""
        return [self.completion(0), *self.more_outputs]

    def completion(self, index: int) -> CompletionOutput:
        """This output's own sequence as vLLM's ``CompletionOutput`` number ``index``."""
        cumulative = (
            None
            if self.logprobs is None
            else sum(
                step[token].logprob
                for step, token in zip(self.logprobs, self.token_ids, strict=True)
            )
        )
        return CompletionOutput(
            index=index,
            text=self.text,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            cumulative_logprob=cumulative,
            stop_reason=self.stop_reason,
        )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for load reports and metrics."""

    num_running: int
    num_waiting: int
    num_reserved: int
    """Decode role: requests holding blocks while their KV arrives."""
    num_held: int
    """Prefill role: stopped requests whose blocks wait to be pushed."""
    num_blocks_used: int
    num_blocks_total: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions_total: int
    num_draft_tokens_total: int = 0
    """Speculative decoding: proposed tokens verified since start."""
    num_accepted_tokens_total: int = 0
    """Speculative decoding: proposed tokens kept since start."""
    lora_fingerprints: tuple[tuple[str, str], ...] = ()
    """(name, fingerprint of its files) of each LoRA adapter new requests may name
    (``EngineCore.lora_names``), by name."""

    lora_running: tuple[str, ...] = ()
    """The adapters of the running requests, sorted (vLLM's ``running_lora_adapters``)."""
    lora_waiting: tuple[str, ...] = ()
    """The adapters of the waiting requests, sorted (vLLM's ``waiting_lora_adapters``)."""
    max_loras: int = 0
    """Adapters loaded at once at most; 0 with LoRA off."""

    @property
    def lora_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.lora_fingerprints)

    def lora_fingerprint(self, name: str | None) -> str:
        """The fingerprint of adapter ``name``'s files; "" for the base model (None) or an
        adapter not loaded."""
        return next((fp for loaded, fp in self.lora_fingerprints if loaded == name), "")

    @property
    def kv_cache_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0


@dataclass(frozen=True)
class EmbeddingOutput:
    """vLLM's: one prompt's embedding (``PoolingParams``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class EmbeddingRequestOutput:
    """vLLM's ``LLM.embed`` result for one prompt: ``out.outputs.embedding``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass(frozen=True)
class ScoringOutput:
    """vLLM's: one pair's score (with an embedding model, their embeddings' cosine)."""

    score: float


@dataclass(frozen=True)
class ScoringRequestOutput:
    """vLLM's ``LLM.score`` result for one pair: ``out.outputs.score``."""

    outputs: ScoringOutput
