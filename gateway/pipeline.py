"""The one front-end pipeline, in the one order both APIs (OpenAI HTTP, public gRPC) run it:

0. CHECK: what needs no tokenizer (model name, sampling ranges, stop strings) is checked by the
   API itself before anything here, so a bad request never waits for a slot.
1. ADMISSION (``admitted``): a slot of the gateway-wide bound; a full queue is a 429 /
   RESOURCE_EXHAUSTED. The slot is held until the response ends, however it ends.
2. TOKENIZE (``tokenize``): in a thread, because a long prompt takes seconds (4 MiB: ~6 s) and
   on the event loop would stall every other stream; the tokenizer releases the GIL. Length
   checks that need the token count (max_tokens against the context) come with it.
3. GENERATE → TEXT (``generate_text``): the routed generator's token events for one request,
   as text events (incremental detokenizer, stop strings). Leaving the block closes both, which
   cancels the node legs of a generation that did not run to its end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from gateway.frontend import Frontend
from gateway.generation import GenerationRequest, close_events
from gateway.text.text_stream import TextEvent, stream_text

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class TextOptions:
    """How token events become text: the request's stop strings and detokenizer flags."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@asynccontextmanager
async def admitted(frontend: Frontend) -> AsyncIterator[None]:
    queued_at = time.monotonic()
    async with frontend.admission.admit():
        frontend.metrics.request_queue_time.observe(time.monotonic() - queued_at)
        yield


async def tokenize(encode: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    return await asyncio.to_thread(encode, *args, **kwargs)


@asynccontextmanager
async def generate_text(
    frontend: Frontend,
    request: GenerationRequest,
    options: TextOptions,
) -> AsyncIterator[AsyncIterator[TextEvent]]:
    events = frontend.generator.generate(request)
    try:
        texts = stream_text(
            events,
            frontend.tokenizer,
            request.prompt_token_ids,
            stop=options.stop,
            include_stop_str_in_output=options.include_stop_str_in_output,
            skip_special_tokens=options.skip_special_tokens,
            stop_token_ids=request.sampling.stop_token_ids,
            eos_token_ids=() if request.sampling.ignore_eos else frontend.tokenizer.eos_token_ids,
            min_tokens=request.sampling.min_tokens,
        )
        try:
            yield texts
        finally:
            await close_events(texts)
    finally:
        await close_events(events)
