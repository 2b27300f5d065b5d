"""``use_beam_search`` (vLLM's extension) over the nodes: each prompt's ``n`` choices are its
``n`` best beams, searched by ``services.beam_search`` with every round's one-token requests
sent through the generator at once.

Life cycle, with ``ChoiceFanout``'s interface so that the response runs either: ``async with
BeamSearchFanout(...)`` starts one search task per prompt → each round asks the generator for
one token of every live beam (``max_tokens=1``, ``2 n`` logprobs, the request's model, salt and
priority), all at once, and feeds their logprobs to the search → when a prompt's search ends,
its best beams go through ``stream_text`` as a generation's tokens would (the same
detokenization, EOS left out of the text) and become that prompt's choices → leaving the block
cancels the searches, and closing each round's iterators cancels their node legs. A round that
fails (a node's refusal, no node) fails the request: before any choice has an event, it is the
response's status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence

from gateway.errors import ErrorKind, GatewayError
from gateway.frontend import Frontend
from gateway.generation import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    TokenChunk,
    close_events,
)
from gateway.http_api.choice_fanout import ChoiceEvent, ChoiceQueue
from gateway.pipeline import TextOptions
from gateway.text.text_stream import TextFinished, stream_text
from services.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence
from services.types import FinishReason, StageTimings, Usage
from services.types.logprob import Logprob

logger = logging.getLogger(__name__)


class BeamSearchFanout(ChoiceQueue):
    """The choices of one ``use_beam_search`` request, in choice order: prompt 0's ``n`` best
    beams, then prompt 1's..."""

    def __init__(
        self,
        frontend: Frontend,
        requests: Sequence[GenerationRequest],
        options: TextOptions,
        n: int,
        length_penalty: float,
    ) -> None:
        """``requests``: ``choice_requests``' (one per choice, ``n`` per prompt); each prompt's
        first gives its prompt, its resolved ``max_tokens`` and what every round's requests
        carry."""
        super().__init__(len(requests))
        self._frontend = frontend
        self._requests = requests
        self._options = options
        self._n = n
        self._length_penalty = length_penalty

    def _start(self) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self._search(first), name=self._requests[first].request_id)
            for first in range(0, len(self._requests), self._n)
        ]

    async def _search(self, first: int) -> None:
        """The search of the prompt whose choices start at ``first``; its choices' events, or
        the round's error for each of them."""
        request = self._requests[first]
        try:
            sequences = await self._beams(request)
            for offset in range(self._n):
                index = first + offset
                if offset < len(sequences):
                    async for event in self._text(request, sequences[offset]):
                        self._queue.put_nowait((index, event))
                else:  # fewer completed beams than n (a vocabulary smaller than 2 n)
                    self._queue.put_nowait((index, _empty(request)))
        except GatewayError as error:
            for offset in range(self._n):
                self._queue.put_nowait((first + offset, error))
        except Exception as error:  # a bug: the request fails, the server goes on
            logger.exception("request %s: beam search failed", request.request_id)
            for offset in range(self._n):
                self._queue.put_nowait((first + offset, error))

    async def _beams(self, request: GenerationRequest) -> list[BeamSearchSequence]:
        sampling = request.sampling
        params = BeamSearchParams(
            beam_width=self._n,
            max_tokens=sampling.max_tokens,
            ignore_eos=sampling.ignore_eos,
            temperature=sampling.temperature,
            length_penalty=self._length_penalty,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
        )
        tokenizer = self._frontend.tokenizer
        search = BeamSearch(
            [request.prompt_token_ids],
            params,
            eos_token_ids=tokenizer.eos_token_ids,
            vocab_size=tokenizer.vocab_size,
            max_model_len=self._frontend.limits.max_model_len,
        )
        # The round's, as the offline search asks (no top-p, top-k or penalties from the
        # model's generation config), with the request's own model, salt, priority and seed.
        round_sampling = dataclasses.replace(
            search.round_params,
            seed=sampling.seed,
            priority=sampling.priority,
            cache_salt=sampling.cache_salt,
            lora_name=sampling.lora_name,
        )
        step = 0
        while beams := search.beams():
            rows = await asyncio.gather(
                *(
                    self._next_logprobs(
                        dataclasses.replace(
                            request,
                            request_id=f"{request.request_id}-beam{step}.{i}",
                            prompt_token_ids=tuple(tokens),
                            sampling=round_sampling,
                        )
                    )
                    for i, tokens in enumerate(beams)
                )
            )
            search.advance(rows)
            step += 1
        (output,) = search.results()
        return output.sequences

    async def _next_logprobs(self, request: GenerationRequest) -> dict[int, Logprob]:
        """The one token ``request`` generates: {sampled id: its logprob, plus the top ids'}.
        Read to its ``Finished``, so that the generation counts as finished, not cancelled."""
        events = self._frontend.generator.generate(request)
        row: dict[int, Logprob] | None = None
        try:
            async for event in events:
                if isinstance(event, TokenChunk) and event.logprobs and row is None:
                    sampled = event.logprobs[0]
                    row = {sampled.token_id: Logprob(sampled.logprob)}
                    for token_id, logprob in sampled.top:
                        row.setdefault(token_id, Logprob(logprob))
                elif isinstance(event, Finished):
                    if row is None or event.finish_reason is FinishReason.ERROR:
                        raise GatewayError(
                            ErrorKind.UNAVAILABLE,
                            f"a beam search step ended {event.finish_reason} without a token: "
                            f"{event.error or 'no reason given'}",
                        )
                    return row
            raise GatewayError(ErrorKind.UNAVAILABLE, "a beam search step ended without a token")
        finally:
            await close_events(events)

    async def _text(
        self, request: GenerationRequest, beam: BeamSearchSequence
    ) -> AsyncIterator[ChoiceEvent]:
        """A beam's generated tokens as a generation's text events (one token a chunk)."""
        tokens = beam.output_token_ids
        reason = beam.finish_reason or FinishReason.LENGTH
        usage = Usage(len(request.prompt_token_ids), len(tokens))

        async def events() -> AsyncIterator[GenerationEvent]:
            for token_id in tokens:
                yield TokenChunk((token_id,))
            yield Finished(reason, usage)

        eos = () if request.sampling.ignore_eos else self._frontend.tokenizer.eos_token_ids
        async for event in stream_text(
            events(),
            self._frontend.tokenizer,
            request.prompt_token_ids,
            include_stop_str_in_output=self._options.include_stop_str_in_output,
            skip_special_tokens=self._options.skip_special_tokens,
            eos_token_ids=eos,
        ):
            yield event


def _empty(request: GenerationRequest) -> TextFinished:
    return TextFinished(
        finish_reason=FinishReason.STOP,
        usage=Usage(len(request.prompt_token_ids), 0),
        timings=StageTimings(),
        error=None,
        stop_reason=None,
    )
