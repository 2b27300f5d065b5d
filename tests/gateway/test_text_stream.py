"""stream_text over fake generation events: text, stops, cancellation and the final event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.generation import Finished, GenerationEvent, StopGeneration, TokenChunk
from gateway.text.text_stream import TextDelta, TextEvent, TextFinished, stream_text
from gateway.text.tokenizer import Tokenizer
from services.types import FinishReason, StageTimings, TokenLogprob, Usage

TIMINGS = StageTimings(prefill_compute_s=0.5, decode_s=1.5)
STOPPED_TIMINGS = StageTimings(prefill_compute_s=0.5, gateway_queue_s=0.25)
"""What legs stopped early know: no decode stage (that comes with the decode node's Finished)."""
PROMPT = "Say it:"


@dataclass
class FakeLegs:
    """The node legs of one request: yields ``events``, records how the iterator ended."""

    events: list[GenerationEvent]
    error_before_first: GatewayError | None = None
    can_stop_early: bool = True
    """Answers ``StopGeneration`` as the routed generator does; else it ends as on a close."""
    num_pulled: int = 0
    is_cancelled: bool = False
    """Closed or stopped before yielding its Finished, as a cancelled request's legs are."""
    pulled: list[GenerationEvent] = field(default_factory=list)
    is_cancelled_when_seen: list[bool] = field(default_factory=list)
    """``is_cancelled`` as the consumer received each text event."""

    async def generate(self) -> AsyncIterator[GenerationEvent]:
        if self.error_before_first is not None:
            raise self.error_before_first
        try:
            for event in self.events:
                self.pulled.append(event)
                try:
                    yield event
                except StopGeneration:
                    self.is_cancelled = True
                    if not self.can_stop_early:
                        raise
                    num_sent = sum(
                        len(e.token_ids) for e in self.pulled if isinstance(e, TokenChunk)
                    )
                    usage = Usage(7, num_sent, cached_prompt_tokens=3)
                    yield Finished(FinishReason.STOP, usage, STOPPED_TIMINGS, num_retries=1)
                    return
        except GeneratorExit:
            # Closed after the Finished is harmless: the legs are done by then.
            self.is_cancelled = not any(isinstance(event, Finished) for event in self.pulled)
            raise


def chunks_of(
    token_ids: Sequence[int], size: int, with_logprobs: bool = False
) -> list[GenerationEvent]:
    events: list[GenerationEvent] = []
    for start in range(0, len(token_ids), size):
        ids = tuple(token_ids[start : start + size])
        logprobs = None
        if with_logprobs:
            logprobs = tuple(
                TokenLogprob(token_id, -0.1 * token_id, top=((token_id, -0.1 * token_id),))
                for token_id in ids
            )
        events.append(TokenChunk(ids, logprobs))
    return events


def finished(
    num_tokens: int, reason: FinishReason = FinishReason.LENGTH, error: str | None = None
) -> Finished:
    return Finished(reason, Usage(7, num_tokens, cached_prompt_tokens=3), TIMINGS, error)


def run(
    legs: FakeLegs,
    tokenizer: Tokenizer,
    stop: tuple[str, ...] = (),
    include_stop_str_in_output: bool = False,
    max_events: int | None = None,
    **options: Any,
) -> list[TextEvent]:
    """Drive stream_text to its end, or stop reading after ``max_events`` as a client might."""

    async def main() -> list[TextEvent]:
        prompt_ids = tokenizer.encode(PROMPT)
        stream = stream_text(
            legs.generate(),
            tokenizer,
            prompt_ids,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
            **options,
        )
        out: list[TextEvent] = []
        async for event in stream:
            out.append(event)
            legs.is_cancelled_when_seen.append(legs.is_cancelled)
            if max_events is not None and len(out) == max_events:
                await stream.aclose()  # type: ignore[attr-defined]
                break
        return out

    return asyncio.run(main())


def text_of(events: list[TextEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))


def first_token_completing(tokenizer: Tokenizer, token_ids: Sequence[int], text: str) -> int:
    """Index of the token whose decode first contains ``text``."""
    for end in range(1, len(token_ids) + 1):
        if text in tokenizer.decode(token_ids[:end]):
            return end - 1
    raise AssertionError(f"{text!r} not in the decoded tokens")


def test_plain_stream_one_delta_per_chunk(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("Hello world, café 鿋 and 😀 too.", add_special_tokens=False)
    chunks = chunks_of(token_ids, 2)
    legs = FakeLegs([*chunks, finished(len(token_ids))])
    events = run(legs, tokenizer)
    deltas, final = events[:-1], events[-1]
    assert len(deltas) == len(chunks)
    assert [delta.token_ids for delta in deltas] == [chunk.token_ids for chunk in chunks]
    assert text_of(events) == "Hello world, café 鿋 and 😀 too."
    assert not any("\ufffd" in delta.text for delta in deltas)
    assert final == TextFinished(
        FinishReason.LENGTH, Usage(7, len(token_ids), 3), TIMINGS, None, stop_reason=None
    )
    assert not legs.is_cancelled


def test_stop_string_mid_chunk_cancels_the_legs(tokenizer: Tokenizer) -> None:
    text = "The answer is 42. END and then the model kept going for a while"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    stop_index = first_token_completing(tokenizer, token_ids, "END")
    chunk_size = 4
    assert stop_index % chunk_size != chunk_size - 1, "the stop must complete mid-chunk"
    legs = FakeLegs([*chunks_of(token_ids, chunk_size), finished(len(token_ids))])

    events = run(legs, tokenizer, stop=("END", "never"))

    # Cancelled before the client saw the stop's delta, not once the stream was drained.
    assert legs.is_cancelled_when_seen[-2:] == [True, True]
    assert not any(legs.is_cancelled_when_seen[:-2])
    assert len(legs.pulled) == stop_index // chunk_size + 1  # nothing read past the stop's chunk
    assert text_of(events) == "The answer is 42. "
    last_delta, final = events[-2], events[-1]
    assert isinstance(last_delta, TextDelta)
    # The last delta ends with the token that completed the stop; later ones are dropped.
    assert last_delta.token_ids[-1] == token_ids[stop_index]
    # The legs' own last Finished says what they knew: the cache hits, the stages, the retries.
    # Its count of tokens sent (the stop's whole chunk) gives way to the tokens up to the stop.
    assert final == TextFinished(
        FinishReason.STOP,
        Usage(7, stop_index + 1, cached_prompt_tokens=3),
        STOPPED_TIMINGS,
        None,
        stop_reason="END",
        num_retries=1,
    )


def test_a_stop_string_closes_events_that_cannot_stop_early(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("one, two, three, four", add_special_tokens=False)
    stop_index = first_token_completing(tokenizer, token_ids, "two")
    legs = FakeLegs([*chunks_of(token_ids, 1), finished(len(token_ids))], can_stop_early=False)
    events = run(legs, tokenizer, stop=("two",))
    assert legs.is_cancelled_when_seen[-2:] == [True, True]
    assert len(legs.pulled) == stop_index + 1
    assert text_of(events) == "one, "
    num_prompt_tokens = len(tokenizer.encode(PROMPT))
    assert events[-1] == TextFinished(  # nothing known of the stages: none made up
        FinishReason.STOP,
        Usage(num_prompt_tokens, stop_index + 1),
        StageTimings(),
        None,
        stop_reason="two",
    )


def test_stop_string_split_across_chunks_included(tokenizer: Tokenizer) -> None:
    text = "alpha <|stop|> beta"
    # One token per chunk: the stop string spans several chunks.
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    legs = FakeLegs([*chunks_of(token_ids, 1), finished(len(token_ids))])
    events = run(legs, tokenizer, stop=("<|stop|>",), include_stop_str_in_output=True)
    assert text_of(events) == "alpha <|stop|>"
    final = events[-1]
    assert isinstance(final, TextFinished)
    assert final.stop_reason == "<|stop|>"
    assert final.usage.completion_tokens == first_token_completing(tokenizer, token_ids, "|>") + 1
    # Every chunk up to the stop got its delta, held-back ones with empty text.
    deltas = [event for event in events if isinstance(event, TextDelta)]
    assert [d.token_ids for d in deltas] == [(t,) for t in token_ids[: len(deltas)]]
    assert any(d.text == "" for d in deltas)


def test_held_text_is_flushed_at_the_end(tokenizer: Tokenizer) -> None:
    # Ends with a possible stop prefix "<|" and half of a four-byte emoji.
    token_ids = [
        *tokenizer.encode("ok <|", add_special_tokens=False),
        *tokenizer.encode("🦜", add_special_tokens=False)[:2],
    ]
    legs = FakeLegs([*chunks_of(token_ids, 3), finished(len(token_ids))])
    events = run(legs, tokenizer, stop=("<|stop|>",))
    flushed, final = events[-2], events[-1]
    assert isinstance(flushed, TextDelta)
    assert flushed.token_ids == () and flushed.logprobs is None
    assert flushed.text.startswith("<|")
    assert text_of(events) == tokenizer.decode(token_ids)
    assert isinstance(final, TextFinished) and final.finish_reason is FinishReason.LENGTH


def test_no_empty_flush_delta(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("nothing held", add_special_tokens=False)
    legs = FakeLegs([*chunks_of(token_ids, 5), finished(len(token_ids), FinishReason.STOP)])
    events = run(legs, tokenizer, stop=("zzz",))
    assert len(events) == len(chunks_of(token_ids, 5)) + 1
    assert isinstance(events[-1], TextFinished)
    assert events[-1].finish_reason is FinishReason.STOP and events[-1].stop_reason is None


def test_stop_completed_by_the_flush(tokenizer: Tokenizer) -> None:
    # The flushed U+FFFD of an unfinished character completes the stop string "x\ufffd".
    token_ids = [*tokenizer.encode("ax", False), *tokenizer.encode("🦜", False)[:1]]
    legs = FakeLegs([*chunks_of(token_ids, 1), finished(len(token_ids))])
    events = run(legs, tokenizer, stop=("x\ufffd",))
    assert text_of(events) == "a"
    final = events[-1]
    assert isinstance(final, TextFinished)
    assert final.finish_reason is FinishReason.STOP and final.stop_reason == "x\ufffd"
    assert final.usage == Usage(7, len(token_ids), 3)


def test_logprobs_pass_through(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("x 鿋 y", add_special_tokens=False)
    chunks = chunks_of(token_ids, 2, with_logprobs=True)
    legs = FakeLegs([*chunks, finished(len(token_ids))])
    events = run(legs, tokenizer)
    deltas = [event for event in events if isinstance(event, TextDelta)]
    assert [d.logprobs for d in deltas] == [c.logprobs for c in chunks]  # type: ignore[union-attr]


def test_error_finish_passes_through(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("partial", add_special_tokens=False)
    failure = finished(len(token_ids), FinishReason.ERROR, error="decode node lost")
    events = run(FakeLegs([*chunks_of(token_ids, 2), failure]), tokenizer)
    assert text_of(events) == "partial"
    assert events[-1] == TextFinished(
        FinishReason.ERROR, failure.usage, TIMINGS, "decode node lost", None
    )


def test_events_without_finished_end_in_error(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("cut short", add_special_tokens=False)
    events = run(FakeLegs(chunks_of(token_ids, 2)), tokenizer)
    final = events[-1]
    assert text_of(events) == "cut short"
    assert isinstance(final, TextFinished)
    assert final.finish_reason is FinishReason.ERROR
    assert final.usage.completion_tokens == len(token_ids)
    assert sum(isinstance(event, TextFinished) for event in events) == 1


def test_consumer_stopping_early_cancels_the_legs(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("a long answer the client stops reading", False)
    legs = FakeLegs([*chunks_of(token_ids, 1), finished(len(token_ids))])
    events = run(legs, tokenizer, max_events=2)
    assert len(events) == 2
    assert legs.is_cancelled
    assert len(legs.pulled) == 2


def test_error_before_the_first_chunk_propagates(tokenizer: Tokenizer) -> None:
    legs = FakeLegs([], error_before_first=invalid("prompt too long", param="prompt"))
    with pytest.raises(GatewayError) as raised:
        run(legs, tokenizer)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT


# --- the token that stopped the generation (vLLM: not in the text, its id the stop_reason) ----


def test_a_stop_token_is_left_out_of_the_text_and_is_the_stop_reason(
    tokenizer: Tokenizer,
) -> None:
    token_ids = tokenizer.encode("Hello world", add_special_tokens=False)
    stop_id = token_ids[-1]  # " world"
    legs = FakeLegs([*chunks_of(token_ids, 1), finished(len(token_ids), FinishReason.STOP)])
    events = run(legs, tokenizer, stop_token_ids=(stop_id,))
    assert text_of(events) == tokenizer.decode(token_ids[:-1])
    assert [event.token_ids for event in events if isinstance(event, TextDelta)][-1] == (stop_id,)
    final = events[-1]
    assert isinstance(final, TextFinished)
    assert final.finish_reason is FinishReason.STOP and final.stop_reason == stop_id
    assert final.usage.completion_tokens == len(token_ids)

    legs = FakeLegs([*chunks_of(token_ids, 3), finished(len(token_ids), FinishReason.STOP)])
    events = run(legs, tokenizer, stop_token_ids=(stop_id,), include_stop_str_in_output=True)
    assert text_of(events) == "Hello world"
    assert events[-1].stop_reason == stop_id  # type: ignore[union-attr]


def test_a_stop_token_that_did_not_stop_keeps_its_text(tokenizer: Tokenizer) -> None:
    """min_tokens lets a stop token through: its text is held only until the next token."""
    token_ids = tokenizer.encode("Hello world and more world", add_special_tokens=False)
    stop_id = tokenizer.encode("Hello world", add_special_tokens=False)[-1]
    assert token_ids.count(stop_id) == 2
    legs = FakeLegs([*chunks_of(token_ids, 1), finished(len(token_ids), FinishReason.LENGTH)])
    events = run(legs, tokenizer, stop_token_ids=(stop_id,))
    assert text_of(events) == "Hello world and more world"
    assert events[-1].stop_reason is None  # type: ignore[union-attr]


def test_the_eos_token_is_left_out_of_the_text_without_skip_special_tokens(
    tokenizer: Tokenizer,
) -> None:
    (eos,) = tokenizer.eos_token_ids
    token_ids = [*tokenizer.encode("Hi there", add_special_tokens=False), eos]
    legs = FakeLegs([*chunks_of(token_ids, 2), finished(len(token_ids), FinishReason.STOP)])
    events = run(legs, tokenizer, skip_special_tokens=False, eos_token_ids=(eos,))
    assert text_of(events) == "Hi there"
    assert events[-1].stop_reason is None  # type: ignore[union-attr]
    # ignore_eos: the EOS is ordinary output (the front end then passes no eos_token_ids).
    legs = FakeLegs([*chunks_of(token_ids, 2), finished(len(token_ids), FinishReason.LENGTH)])
    events = run(legs, tokenizer, skip_special_tokens=False, eos_token_ids=(eos,))
    assert text_of(events) == "Hi there" + tokenizer.decode([eos], skip_special_tokens=False)


def test_stop_strings_wait_for_min_tokens(tokenizer: Tokenizer) -> None:
    """As vLLM: a stop string counts only once the output is past min_tokens; one that began
    before and ends after it still counts."""
    token_ids = tokenizer.encode("Hello world and world again", add_special_tokens=False)
    first = first_token_completing(tokenizer, token_ids, "world")
    for min_tokens, expected in ((first, "Hello "), (first + 1, "Hello world and ")):
        legs = FakeLegs([*chunks_of(token_ids, 2), finished(len(token_ids))])
        events = run(legs, tokenizer, stop=("world",), min_tokens=min_tokens)
        assert text_of(events) == expected, min_tokens
        assert events[-1].stop_reason == "world"  # type: ignore[union-attr]
    # "o world" begins within the first min_tokens tokens and ends past them.
    legs = FakeLegs([*chunks_of(token_ids, 1), finished(len(token_ids))])
    events = run(legs, tokenizer, stop=("o world",), min_tokens=first)
    assert text_of(events) == "Hell"
