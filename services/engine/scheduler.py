"""Continuous batching: which tokens of which requests the next step computes.

Each step has a token budget (``max_num_batched_tokens``) shared by every request:

1. Running requests first, in order: a decode takes one token, an unfinished prompt takes the
   next chunk that fits the budget (chunked prefill, mixed with the decodes). When the cache has
   no room for a request's new tokens, the lowest-priority running request is preempted (its
   blocks freed, its tokens recomputed later) until there is room or the request preempts itself.
2. Then, if nothing was preempted, waiting requests join while the budget, ``max_num_seqs`` and
   the cache allow, starting from their longest prefix-cache hit.

After the model ran, ``update_from_output`` advances every scheduled request, appends sampled
tokens, applies the stop conditions and frees the blocks of finished requests.

Pure Python: no torch, no grpc. The model runner sees ``SchedulerOutput`` only.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.engine.config import SchedulerConfig, SchedulingPolicy
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """The tokens of one request computed this step."""

    request: Request
    start_position: int
    """Position of the first token of the chunk (the request's computed tokens before it)."""
    num_tokens: int
    block_ids: list[int]
    """The request's whole block table after allocation."""
    needs_sample: bool
    """The chunk reaches the request's last known token, so its logits give the next one."""
    draft_token_ids: tuple[int, ...] = ()
    """Speculative decoding: proposed tokens after the request's last one, the chunk's last
    ``len(draft_token_ids)`` tokens; a sample at each of the chunk's last ``1 + len`` positions
    verifies them (``services/engine/speculative.py``)."""

    @property
    def token_ids(self) -> list[int]:
        end = self.start_position + self.num_tokens - len(self.draft_token_ids)
        tokens = self.request.token_ids[self.start_position : end]
        if self.draft_token_ids:
            tokens.extend(self.draft_token_ids)
        return tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted_request_ids: list[str]

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None = None
    rank: int | None = None
    """With ``logprobs``: the token's rank in the vocabulary (``SampleResult.ranks``); None where
    not computed (a first token committed from another node)."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """A decode-side request's blocks for its whole prompt, held until the KV arrives."""

    block_ids: list[int]
    """In token order: block i holds tokens [i * block_size, (i + 1) * block_size)."""
    num_cached_blocks: int
    """The first blocks came from this engine's prefix cache and hold the prompt's KV already
    (shared with the requests that computed it): a peer writes ``block_ids[num_cached_blocks:]``
    only. Never all of them (``KVCacheManager.get_computed_blocks`` leaves the last token out)."""


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        *,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}
        """Decode side: blocks held for a prompt whose KV a prefill node is writing."""
        self.held: dict[str, Request] = {}
        """Prefill side: stopped requests whose blocks stay until ``release_held``."""
        self.requests: dict[str, Request] = {}
        """Every request that is waiting, reserved or running."""
        self.num_preemptions_total = 0
        self.num_draft_tokens_total = 0
        """Speculative decoding: proposed tokens verified, and those of them kept."""
        self.num_accepted_tokens_total = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_work(self) -> bool:
        """Something ``schedule`` can run: reserved requests wait on their peer, not on us."""
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, request.request_id
        assert request.status is RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def can_reserve(self, request: Request) -> bool:
        """Room for ``request``'s prompt (past its prefix-cache hit), and for one more sequence
        in the batch it will join."""
        if len(self.running) + len(self.reserved) >= self.config.max_num_seqs:
            return False
        computed_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
        return self.kv_cache.can_allocate(
            request, request.num_prompt_tokens - num_hit, computed_blocks
        )

    def reserve(self, request: Request) -> Reservation:
        """Blocks for the whole prompt of a decode-side request: its longest prefix-cache hit,
        shared, then new blocks for the rest.

        The request is not scheduled until ``commit``: a prefill node writes the prompt's KV
        into the new blocks meanwhile (a shared prompt, such as a system prompt or a chat's
        earlier turns, is neither pushed again nor held twice).
        """
        assert request.request_id not in self.requests, request.request_id
        assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
        computed_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
        self.kv_cache.allocate(request, request.num_prompt_tokens - num_hit, computed_blocks)
        if self.kv_cache.enable_prefix_caching:
            self.kv_cache.record_prefix_lookup(request.num_prompt_tokens, num_hit)
        request.status = RequestStatus.RESERVED
        self.requests[request.request_id] = request
        self.reserved[request.request_id] = request
        return Reservation(self.kv_cache.block_ids(request.request_id), len(computed_blocks))

    def commit(self, request_id: str, first_token: SampledToken) -> Request:
        """The prompt's KV is in the reserved blocks: join the running batch with the first token
        (sampled by the prefill node), or finish at once if that token already stops it."""
        request = self.reserved.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = 0
        # A prefix committed meanwhile by another reservation is held once.
        self.kv_cache.share_cached_prefix(request)
        self.kv_cache.cache_full_blocks(request)
        request.append_output(first_token.token_id, first_token.logprobs, first_token.rank)
        stop_status = self._check_stop(request)
        if stop_status is not None:
            self._finish(request, stop_status)
        else:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return request

    def release_held(self, request_id: str) -> Request | None:
        """Free a stopped ``hold_kv`` request's blocks (its pages were pushed or abandoned)."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv_cache.free(request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its blocks; None if it is not known.

        A held request (stopped, blocks kept for a push) is released as well.
        """
        held = self.release_held(request_id)
        if held is not None:
            return held
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.RESERVED:
            del self.reserved[request_id]
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        if self.config.policy is SchedulingPolicy.PRIORITY:
            # The last running request is always the one to preempt.
            self.running.sort(key=lambda r: r.priority_key)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"{request.request_id} is running with nothing to compute"
            # Proposals never take the token a later running request needs this step.
            drafts = (
                self._drafts(request, num_new, budget - (len(self.running) - index - 1))
                if request.draft_token_ids
                else ()
            )
            # Proposals take room only where there is some: without, the plain decode runs
            # (and may still preempt).
            if drafts and self.kv_cache.try_allocate(request, num_new + len(drafts)):
                chunks.append(self._chunk(request, num_new + len(drafts), drafts))
                budget -= num_new + len(drafts)
                index += 1
                continue
            if self.kv_cache.try_allocate(request, num_new):
                chunks.append(self._chunk(request, num_new))
                budget -= num_new
                index += 1
                continue
            # No room: preempt the last running request (this one, once it is the last) and
            # try again; a preempted request leaves `running`, so the loop ends at it.
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)

        if not preempted:
            self._admit_waiting(chunks, budget)
        return SchedulerOutput(chunks, [r.request_id for r in preempted])

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, Sequence[SampledToken]]
    ) -> list[Request]:
        """Advance the scheduled requests; returns those that got a token or finished.

        ``sampled`` holds each sampling chunk's tokens: one, or with proposals
        (``ScheduledChunk.draft_token_ids``) the ones kept and the sample after them, appended
        in order until one stops the request."""
        updated: list[Request] = []
        for chunk in output.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule() and now
            if not chunk.needs_sample or request.pooling is not None:
                request.num_computed_tokens += chunk.num_tokens
                self.kv_cache.cache_full_blocks(request)
                if chunk.needs_sample:  # an embedding request: its vector is its output
                    self.running.remove(request)
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    updated.append(request)
                continue
            tokens = sampled[request.request_id]
            if chunk.draft_token_ids:
                self.num_draft_tokens_total += len(chunk.draft_token_ids)
                self.num_accepted_tokens_total += len(tokens) - 1
            if request.draft_token_ids:
                request.draft_token_ids = []
            for token in tokens:
                request.append_output(token.token_id, token.logprobs, token.rank)
                stop_status = self._check_stop(request)
                if stop_status is not None:
                    break
            # Every token but the last sampled one holds its KV now: the chunk's own, and the
            # kept proposals' (computed at their positions); a rejected proposal's slots are
            # written again by the tokens that take its positions.
            request.num_computed_tokens = len(request.token_ids) - 1
            self.kv_cache.cache_full_blocks(request)
            if stop_status is not None:
                self.running.remove(request)
                self._finish(request, stop_status)
            updated.append(request)
        return updated

    def _admit_waiting(self, chunks: list[ScheduledChunk], budget: int) -> None:
        if self.config.policy is SchedulingPolicy.PRIORITY:
            self.waiting = deque(sorted(self.waiting, key=lambda r: r.priority_key))
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.kv_cache.can_allocate(request, num_new, computed_blocks):
                break
            self.waiting.popleft()
            self.kv_cache.allocate(request, num_new, computed_blocks)
            if self.kv_cache.enable_prefix_caching:
                self.kv_cache.record_prefix_lookup(request.num_tokens, num_hit)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new

    def _chunk(
        self, request: Request, num_new: int, drafts: tuple[int, ...] = ()
    ) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request,
            start,
            num_new,
            self.kv_cache.block_ids(request.request_id),
            start + num_new - len(drafts) == len(request.token_ids),
            drafts,
        )

    def _drafts(self, request: Request, num_new: int, budget: int) -> tuple[int, ...]:
        """The proposals a decode step of ``request`` verifies: as many as the step's budget,
        the model's length and the request's ``max_tokens`` leave room for (each kept one is an
        output token, and the sample after the last one another)."""
        drafts = request.draft_token_ids
        if not drafts or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return ()  # a prompt (or a preempted request's tokens) still to compute
        room = min(
            budget - 1,
            self.max_model_len - request.num_tokens,
            request.params.max_tokens - request.num_output_tokens - 1,
        )
        return tuple(drafts[: max(room, 0)])

    def _preempt(self, request: Request) -> None:
        logger.debug("preempting %s (%d tokens)", request.request_id, request.num_tokens)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.params
        token_id = request.output_token_ids[-1]
        if request.grammar_error is not None:
            return RequestStatus.FINISHED_ERROR  # its text no longer matches the grammar
        if request.is_grammar_complete:
            return RequestStatus.FINISHED_STOPPED  # nothing else can follow, min_tokens or not
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.hold_kv and status.is_success:  # a failed request's pages go to no one
            self.held[request.request_id] = request
        else:
            self.kv_cache.free(request)
        request.status = status
        del self.requests[request.request_id]
