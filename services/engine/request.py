"""A generation request as the scheduler and KV cache manager see it.

Life cycle of a request (``RequestStatus``):

1. ``WAITING``   added; no KV blocks held (or all given back after a preemption).
2. ``RUNNING``   admitted to the running batch; holds blocks for its computed tokens. Each step
                 computes the next chunk of its prompt (chunked prefill) or one decode token.
3. ``PREEMPTED`` its blocks were taken back when the cache ran out; it re-enters the waiting
                 queue at the front and recomputes its tokens (prompt and outputs so far), usually
                 mostly from the prefix cache.
4. ``FINISHED_*`` stopped (EOS / stop token), hit a length limit, was aborted, or failed (its
   grammar: ``grammar_error``); every block is freed before the status is set — except that a
   request added with ``hold_kv`` (a prefill node's) keeps its blocks after it stops or hits its
   length, until the node releases them once its pages are pushed.

A decode node's request enters differently: ``RESERVED`` holds blocks for the prompt while a
prefill node writes its KV into them; nothing is scheduled until ``commit`` hands over the first
token, and the request continues as ``RUNNING`` with its whole prompt computed.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.types import FinishReason, PoolingParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RESERVED = "reserved"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASON

    @property
    def is_success(self) -> bool:
        """Finished with an output its client may use: stopped, or cut at its length."""
        return self is RequestStatus.FINISHED_STOPPED or self is RequestStatus.FINISHED_LENGTH


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    output_logprob_ranks: list[int | None] = field(default_factory=list)
    """Beside ``output_logprobs``: each sampled token's rank in the vocabulary (``SampledToken``;
    None where not computed)."""
    num_computed_tokens: int = 0
    """Tokens of ``token_ids`` whose KV is in the cache; reset to 0 by a preemption."""
    num_cached_tokens: int = -1
    """Prompt tokens served by the prefix cache at first admission (-1 until admitted)."""
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    """time.monotonic() of the first step that computed any of its tokens (set by the engine):
    the end of its queueing. A decode node's request is first scheduled after its commit."""
    hold_kv: bool = False
    """Keep the blocks when the request stops (a prefill node pushes them afterwards)."""
    is_grammar_complete: bool = False
    """Its grammar (``params.guided``) admits no further token but EOS: it stops with ``stop``.
    Set by the engine's structured outputs after each accepted token."""
    grammar_error: str | None = None
    """Why llguidance gave up on its grammar, naming the field: it ends with ``error``, whatever
    else holds. Set by the engine's structured outputs instead of accepting a token."""
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    """With ``params.prompt_logprobs``: entry i is prompt token i's {id: logprob, plus the top-n
    ids}, given the tokens before it (entry 0 stays None); filled as its chunks are computed."""
    prompt_logprob_ranks: list[int | None] = field(default_factory=list)
    """Beside ``prompt_logprobs``: entry i is prompt token i's rank in the vocabulary (1 + the
    tokens with a greater logprob), whether or not it is among the top-n."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the full blocks of ``token_ids``, extended as tokens are added."""
    pooling: PoolingParams | None = None
    """An embedding request: it ends when its prompt is computed, with ``embedding`` and no
    token (``services/engine/pooler.py``)."""
    embedding: list[float] | None = None
    """Set by the step that computed the last prompt token of a ``pooling`` request."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: tokens proposed to follow ``token_ids`` (not part of them), which
    its next decode step verifies (``services/engine/speculative.py``); set after each step."""
    num_emitted_tokens: int = 0
    """Output tokens the engine has handed out (a step may add several: ``EngineCore._output``)."""
    token_ids: list[int] = field(init=False)
    """Prompt followed by outputs; the tokens whose KV the request needs."""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.prompt_logprob_ranks = [None] * len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are still to be computed (they come before its first token)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def priority_key(self) -> tuple[int, float]:
        """Lower sorts first: the order in which the ``priority`` policy serves requests."""
        return (self.params.priority, self.arrival_time)

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)

    def append_output(
        self, token_id: int, logprobs: dict[int, float] | None, rank: int | None = None
    ) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.output_logprob_ranks.append(rank)
