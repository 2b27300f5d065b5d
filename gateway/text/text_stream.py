"""Generation events (token ids) to text events: detokenized, with stop strings applied.

Both API front ends iterate ``stream_text`` over ``Generator.generate``. Per request:

1. Each ``TokenChunk`` becomes one ``TextDelta`` with the chunk's ids and logprobs and the text
   they complete; the text is empty while a character or a possible stop string is held back.
2. A stop string ends the stream: the text before it goes out in the last delta, the node legs
   are cancelled at once (the events are stopped, ``stop_early``, before anything else is
   yielded), and the ``TextFinished`` counts the tokens up to and including the one that
   completed the match, with the stage timings and retries of the events' own last ``Finished``
   (none from events that cannot stop early: they are closed).
3. Otherwise the events' ``Finished`` flushes the held text into a last delta (when there is
   any) and becomes the ``TextFinished``. When that text completes a stop string, the events
   are stopped at their ``Finished`` (``stop_early``), so that they count the request as the
   ``stop`` the client is told, not as what ended the nodes' generation (``length``).

A token that can stop the generation (one of the request's ``stop_token_ids``, or EOS) has its
text held until the next event says whether it did: when the generation stopped on it, its text
is left out (unless ``include_stop_str_in_output``) and a stop token's id is the
``stop_reason``, as vLLM does; when it did not (``min_tokens``), its text goes out with the next
delta. Its id and logprob are sent with its own chunk either way.

Stop strings count only once the output is past ``min_tokens`` tokens, as in vLLM (a stop string
that begins within them and ends past them counts).

Exactly one ``TextFinished`` ends every stream; the events are closed however it ends, so a
consumer that stops early (a client gone) also cancels the node legs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, replace

from gateway.generation import Finished, GenerationEvent, TokenChunk, close_events, stop_early
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopMatch, StopStringMatcher
from gateway.text.tokenizer import Tokenizer
from services.types import FinishReason, StageTimings, TokenLogprob, Usage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextDelta:
    text: str
    """Text these tokens completed; may be empty (held back) or carry earlier tokens' text."""
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    """One per token id when logprobs were asked for."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """In the first delta, with ``sampling.prompt_logprobs``: prompt tokens 1, 2, ..."""


@dataclass(frozen=True)
class TextFinished:
    finish_reason: FinishReason
    usage: Usage
    timings: StageTimings
    error: str | None
    """Set with ``FinishReason.ERROR``."""
    stop_reason: str | int | None
    """The stop string or stop token id that ended the text (vLLM's ``stop_reason``); None
    otherwise (EOS included)."""
    num_retries: int = 0
    """Pairs tried before the one that served the request (known when the nodes finished it)."""
    invalid_request: bool = False
    """With ``FinishReason.ERROR``: the request itself failed (``Finished.invalid_request``)."""


TextEvent = TextDelta | TextFinished


@dataclass(frozen=True)
class _ChunkText:
    text: str
    num_tokens: int
    """Tokens of the chunk consumed: all of them, or up to and including a stop's last."""
    matched: str | None
    held: str | None = None
    """The text of a last token that may have stopped the generation, not yet sent."""


async def stream_text(
    events: AsyncIterator[GenerationEvent],
    tokenizer: Tokenizer,
    prompt_token_ids: Sequence[int],
    stop: tuple[str, ...] = (),
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
    stop_token_ids: Collection[int] = (),
    eos_token_ids: Collection[int] = (),
    min_tokens: int = 0,
) -> AsyncIterator[TextEvent]:
    """Text events for ``events``: one ``TextDelta`` per ``TokenChunk``, then one ``TextFinished``.

    ``eos_token_ids``: the EOS ids the generation stops on (none with ``ignore_eos``).
    A ``GatewayError`` the events raise before their first chunk propagates unchanged.
    """
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    matcher = StopStringMatcher(stop, include_stop_str_in_output)
    # With include_stop_str_in_output a stopping token's text is output like any other.
    stoppers = frozenset(() if include_stop_str_in_output else (*stop_token_ids, *eos_token_ids))
    num_output_tokens = 0
    last_token_id: int | None = None
    held: str | None = None
    try:
        async for event in events:
            if isinstance(event, Finished):
                is_stop_token = event.finish_reason is FinishReason.STOP and (
                    held is not None or last_token_id in stop_token_ids
                )
                if held is not None and is_stop_token:
                    # The generation stopped on that token: its text is no part of the output.
                    tail = StopMatch(matcher.flush())
                else:
                    may_stop = num_output_tokens > min_tokens
                    tail = _flush(detokenizer, matcher, held or "", may_stop)
                if tail.stopped and event.finish_reason is not FinishReason.STOP:
                    # The nodes ended it otherwise (max_tokens): the events count it as a stop.
                    await stop_early(events)
                # Settled before the client sees the end: the request is counted by then.
                await close_events(events)
                if tail.text:
                    yield TextDelta(tail.text, (), None)
                stop_reason: str | int | None = tail.matched
                if stop_reason is None and is_stop_token and last_token_id in stop_token_ids:
                    stop_reason = last_token_id
                yield TextFinished(
                    finish_reason=FinishReason.STOP if tail.stopped else event.finish_reason,
                    usage=event.usage,
                    timings=event.timings,
                    error=None if tail.stopped else event.error,
                    stop_reason=stop_reason,
                    num_retries=event.num_retries,
                    invalid_request=event.invalid_request and not tail.stopped,
                )
                return
            chunk = _chunk_text(
                event, detokenizer, matcher, held or "", stoppers, num_output_tokens - min_tokens
            )
            held = chunk.held
            if event.token_ids:
                last_token_id = event.token_ids[-1]
            num_output_tokens += chunk.num_tokens
            token_ids = event.token_ids[: chunk.num_tokens]
            logprobs = None if event.logprobs is None else event.logprobs[: chunk.num_tokens]
            if chunk.matched is None:
                yield TextDelta(chunk.text, token_ids, logprobs, event.prompt_logprobs)
                continue
            # Cancel the node legs before the client sees anything: they are still decoding.
            stopped = await stop_early(events)
            await close_events(events)
            yield TextDelta(chunk.text, token_ids, logprobs, event.prompt_logprobs)
            if stopped is None:
                stopped = Finished(FinishReason.STOP, Usage(len(prompt_token_ids), 0))
            yield TextFinished(
                finish_reason=FinishReason.STOP,
                # The events counted every token sent, past the stop's too.
                usage=replace(stopped.usage, completion_tokens=num_output_tokens),
                timings=stopped.timings,
                error=None,
                stop_reason=chunk.matched,
                num_retries=stopped.num_retries,
            )
            return
        logger.error("generation events ended without a Finished event")
        tail = _flush(detokenizer, matcher, held or "", num_output_tokens > min_tokens)
        if tail.text:
            yield TextDelta(tail.text, (), None)
        yield TextFinished(
            finish_reason=FinishReason.ERROR,
            usage=Usage(len(prompt_token_ids), num_output_tokens),
            timings=StageTimings(),
            error="generation ended without a final event",
            stop_reason=None,
        )
    finally:
        await close_events(events)


def _chunk_text(
    chunk: TokenChunk,
    detokenizer: IncrementalDetokenizer,
    matcher: StopStringMatcher,
    held: str,
    stoppers: frozenset[int],
    num_past_min_tokens: int,
) -> _ChunkText:
    """``held``: the previous chunk's held text, which this chunk shows was output after all.
    ``num_past_min_tokens``: output tokens before this chunk, less min_tokens."""
    pieces = []
    if held:
        match = matcher.feed(held, may_stop=num_past_min_tokens > 0)
        pieces.append(match.text)
        if match.stopped:  # the stop string ended at the previous chunk's last token
            return _ChunkText("".join(pieces), 0, match.matched)
    # Token by token, so that a stop is pinned to the token that completed it.
    last = len(chunk.token_ids) - 1
    for index, token_id in enumerate(chunk.token_ids):
        text = detokenizer.add((token_id,))
        if index == last and token_id in stoppers:
            return _ChunkText("".join(pieces), len(chunk.token_ids), None, held=text)
        if not text:
            continue
        match = matcher.feed(text, may_stop=num_past_min_tokens + index + 1 > 0)
        pieces.append(match.text)
        if match.stopped:
            return _ChunkText("".join(pieces), index + 1, match.matched)
    return _ChunkText("".join(pieces), len(chunk.token_ids), None)


def _flush(
    detokenizer: IncrementalDetokenizer,
    matcher: StopStringMatcher,
    held: str = "",
    may_stop: bool = True,
) -> StopMatch:
    """The held text at the end of the stream; it may still complete a stop string."""
    match = matcher.feed(held + detokenizer.flush(), may_stop)
    if match.stopped:
        return match
    return StopMatch(match.text + matcher.flush())
