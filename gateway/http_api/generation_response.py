"""The ASGI response that runs one generation request after validation: admission, tokenization,
the choices' generations, and sending them as SSE chunks or one JSON body.

Life cycle of one response (``GenerationResponse.__call__``), while a task watches the ASGI
receive channel for the client's disconnect: an admission slot (429) → tokenization and length
checks (400) → one generation per choice, all started at once → each choice's first event (a
``GatewayError`` here is the response's status, also when streaming) → SSE chunks as tokens
arrive, or one JSON body at the end. A disconnect at any point cancels all of it; so does a
client that stops reading: one send that waits over ``client_send_timeout_s`` for its socket to
drain aborts the request, and uvicorn closes the connection of the response left incomplete. The
admission slot is released when it ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from gateway.errors import ErrorKind, GatewayError
from gateway.frontend import Frontend
from gateway.http_api.beam_search_fanout import BeamSearchFanout
from gateway.http_api.choice_fanout import ChoiceEvent, ChoiceFanout, ChoiceQueue
from gateway.http_api.client_send import SlowClientError, bounded_send, send_json
from gateway.http_api.disconnect import wait_for_disconnect
from gateway.http_api.openai_errors import internal_error_body
from gateway.http_api.openai_format import (
    ChatFormat,
    ChoiceState,
    Chunk,
    CompletionFormat,
    OpenAIFormat,
)
from gateway.http_api.openai_job import OpenAIJob, choice_requests, prompt_token_ids, renamed
from gateway.http_api.openai_protocol import PromptTokensDetails, UsageInfo
from gateway.http_api.sse import DONE, MEDIA_TYPE
from gateway.metrics import stream_failure
from gateway.pipeline import TextOptions, admitted, tokenize
from gateway.text.text_stream import TextDelta, TextFinished
from services.types import FinishReason, StageTimings, Usage

logger = logging.getLogger(__name__)


class GenerationResponse(Response):
    """An ASGI response that runs the request: its status is known only once every choice has
    its first event, so the admission, the generation and the sending all happen here."""

    def __init__(
        self, frontend: Frontend, job: OpenAIJob, output: OpenAIFormat | None = None
    ) -> None:
        """``output``: how the response is shaped; by default the job's route's (completions
        or chat)."""
        super().__init__()
        self._frontend = frontend
        self._job = job
        self._is_started = False
        self._is_client_gone = False
        self._is_internal_error = False
        """A bug in the gateway failed a choice: the request's error reason is ``internal``."""
        self._n = job.body.n
        self._format: OpenAIFormat = output or (ChatFormat if job.is_chat else CompletionFormat)(
            job, frontend.tokenizer, frontend.response_model(job.body.model)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Every send of the response is bounded: a client that stops reading must not hold its
        # admission slot and its node legs for as long as it keeps the connection open.
        send = bounded_send(send, self._frontend.client_send_timeout_s)
        serve = asyncio.create_task(self._serve(send))
        watch = asyncio.create_task(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({serve, watch}, return_when=asyncio.FIRST_COMPLETED)
            if serve not in done:
                self._is_client_gone = True
                # The client is gone: cancelling closes every choice's generation at once.
                logger.info("request %s: client disconnected", self._job.request_id)
                self._frontend.metrics.request_errors.labels(reason="client_disconnected").inc()
                serve.cancel()
            (outcome,) = await asyncio.gather(serve, return_exceptions=True)
            if isinstance(outcome, Exception):  # _serve handles its own; this is sending failing
                logger.error("request %s: response failed: %r", self._job.request_id, outcome)
        finally:
            serve.cancel()
            watch.cancel()
            await asyncio.gather(serve, watch, return_exceptions=True)

    async def _serve(self, send: Send) -> None:
        frontend = self._frontend
        metrics = frontend.metrics
        try:
            async with admitted(frontend):
                prompts = await tokenize(prompt_token_ids, self._job, frontend.tokenizer)
                requests = choice_requests(self._job, prompts, frontend)
                states = [
                    ChoiceState(index=index, prompt_token_ids=request.prompt_token_ids)
                    for index, request in enumerate(requests)
                ]
                options = TextOptions(
                    stop=self._job.stop,
                    include_stop_str_in_output=self._job.body.include_stop_str_in_output,
                    skip_special_tokens=self._job.body.skip_special_tokens,
                )
                body = self._job.body
                fanout: ChoiceQueue = (
                    BeamSearchFanout(
                        frontend, requests, options, self._n, body.length_penalty or 1.0
                    )
                    if body.use_beam_search
                    else ChoiceFanout(frontend, requests, options)
                )
                async with fanout as choices:
                    first_events = await choices.first_events()
                    self._share_prompt_logprobs(states, first_events)
                    if self._job.body.stream:
                        await self._stream(send, states, choices, first_events)
                    else:
                        await self._respond(send, states, choices, first_events)
        except asyncio.CancelledError:
            if not self._is_started and not self._is_client_gone:
                # The server is shutting down before the first token: say so, do not just hang up.
                with contextlib.suppress(Exception):
                    error = GatewayError(ErrorKind.UNAVAILABLE, "the server is shutting down")
                    await self._send_json(send, 503, error.openai_body())
            raise
        except SlowClientError as error:
            # Leaving the fan-out closed every generation. Nothing more is sent: the response
            # stays incomplete, which is what makes uvicorn close the connection.
            logger.warning("request %s: aborted: %s", self._job.request_id, error)
            metrics.request_errors.labels(reason="slow_client").inc()
        except GatewayError as error:
            metrics.request_errors.labels(reason=error.reason).inc()
            refusal = renamed(error, self._job.param_names)  # as the client named the field
            if not self._is_started:
                await self._send_json(
                    send, refusal.kind.http_status, refusal.openai_body(), refusal.http_headers()
                )
        except Exception:
            logger.exception("request %s failed", self._job.request_id)
            metrics.request_errors.labels(reason="internal").inc()
            if not self._is_started:
                await self._send_json(send, 500, internal_error_body())

    def _share_prompt_logprobs(
        self, states: list[ChoiceState], first_events: list[tuple[int, ChoiceEvent]]
    ) -> None:
        """Gives each prompt's other choices the prompt logprobs its first choice's first delta
        carries (only that choice asks for them: ``choice_requests``), before any choice's
        first chunk is formatted: every choice's first event is in ``first_events``."""
        for index, event in first_events:
            if index % self._n or not isinstance(event, TextDelta):
                continue
            if event.prompt_logprobs is not None:
                for follower in states[index + 1 : index + self._n]:
                    follower.prompt_logprobs = event.prompt_logprobs

    async def _stream(
        self,
        send: Send,
        states: list[ChoiceState],
        choices: ChoiceQueue,
        first_events: list[tuple[int, ChoiceEvent]],
    ) -> None:
        headers = [
            (b"content-type", f"{MEDIA_TYPE}; charset=utf-8".encode()),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # nginx and the like: do not hold chunks back
            (b"x-request-id", self._job.request_id.encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        self._is_started = True
        errors: list[str] = []
        error_kind = ErrorKind.INVALID_ARGUMENT  # until a failure that is not the request's

        async def emit(index: int, item: ChoiceEvent | Exception) -> None:
            state = states[index]
            event = self._update(state, item)
            if isinstance(event, TextDelta):
                chunk = self._format.delta_chunk(state, event)
                if chunk is not None:
                    state.is_started = True
                    await self._send_chunk(send, chunk, state)
                return
            await self._send_chunk(send, self._format.finish_chunk(state), state)
            if event.finish_reason == FinishReason.ERROR:
                errors.append(f"choice {index} failed: {event.error or 'unknown error'}")
                if not event.invalid_request:
                    nonlocal error_kind
                    error_kind = ErrorKind.UNAVAILABLE

        try:
            for index, event in first_events:
                await emit(index, event)
            while any(state.finished is None for state in states):
                await emit(*await choices.next())
            if self._job.include_usage:
                await self._send_body(
                    send, self._format.encode_event(self._format.usage_chunk(self._usage(states)))
                )
        except asyncio.CancelledError:
            # Cancelled with the client still there (the server shutting down): end each open
            # choice with "abort" rather than cut the stream. A client that left gets nothing.
            with contextlib.suppress(Exception):
                for state in states:
                    if state.finished is None:
                        state.finished = TextFinished(
                            finish_reason=FinishReason.ABORT,
                            usage=Usage(len(state.prompt_token_ids), state.num_tokens),
                            timings=StageTimings(),
                            error=None,
                            stop_reason=None,
                        )
                        await self._send_chunk(send, self._format.finish_chunk(state), state)
                if self._format.ends_with_done:
                    await self._send_body(send, DONE)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            raise
        except SlowClientError:
            raise  # the client reads nothing: no error event could reach it either
        except Exception:  # a bug: end the stream visibly rather than leave the client hanging
            logger.exception("request %s: stream failed", self._job.request_id)
            self._is_internal_error = True
            errors.append("internal error")
            error_kind = ErrorKind.UNAVAILABLE
        if errors:
            error = GatewayError(error_kind, "; ".join(errors))
            await self._send_body(send, self._format.encode_event(self._format.error_event(error)))
        if self._format.ends_with_done:
            await self._send_body(send, DONE)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        # After the last send: a client that left or stopped reading meanwhile is the reason.
        self._count_failure(states)

    async def _respond(
        self,
        send: Send,
        states: list[ChoiceState],
        choices: ChoiceQueue,
        first_events: list[tuple[int, ChoiceEvent]],
    ) -> None:
        for index, event in first_events:
            self._update(states[index], event)
        while any(state.finished is None for state in states):
            index, item = await choices.next()
            self._update(states[index], item)
        failed = [
            s for s in states if s.finished and s.finished.finish_reason == FinishReason.ERROR
        ]
        if failed:
            # Nothing reached the client yet: a whole error beats a silently truncated text.
            message = "; ".join(
                f"choice {s.index} failed after {s.num_tokens} tokens: {s.finished.error}"
                for s in failed
                if s.finished is not None
            )
            # The request's own fault (its grammar failed while it ran) only when every failed
            # choice's was: a 400 a client does not retry, where a 503 invites one.
            kind = (
                ErrorKind.INVALID_ARGUMENT
                if all(s.finished is not None and s.finished.invalid_request for s in failed)
                else ErrorKind.UNAVAILABLE
            )
            await self._send_json(send, kind.http_status, GatewayError(kind, message).openai_body())
        else:
            response = self._format.response(states, self._usage(states))
            await self._send_json(send, 200, response)
        self._count_failure(states)

    def _count_failure(self, states: Sequence[ChoiceState]) -> None:
        """Counts the request in ``request_errors`` once if it failed: a bug, or else the first
        choice that ended early (``stream_failure``). Refusals are counted where they are caught.
        """
        reasons = ["internal"] if self._is_internal_error else []
        reasons += [
            reason
            for state in states
            if state.finished
            and (
                reason := stream_failure(
                    state.finished.finish_reason, state.finished.invalid_request
                )
            )
        ]
        if reasons:
            self._frontend.metrics.request_errors.labels(reason=reasons[0]).inc()

    def _update(self, state: ChoiceState, item: ChoiceEvent | Exception) -> ChoiceEvent:
        """Record one event of a choice; an exception after the choice's first event ends it
        with reason ``error``.

        NOTE: latency and finish metrics are the generator's to observe (it sees every front
        end's tokens); observing them here too would count each request twice.
        """
        if isinstance(item, Exception):
            self._is_internal_error = True  # generators raise only before their first event
            item = TextFinished(
                finish_reason=FinishReason.ERROR,
                usage=Usage(len(state.prompt_token_ids), state.num_tokens),
                timings=StageTimings(),
                error=str(item) or type(item).__name__,
                stop_reason=None,
            )
        if isinstance(item, TextFinished):
            state.finished = item
            return item
        # Legacy text offsets: where each token starts, clamped into this delta's text.
        end = state.num_chars + len(item.text)
        offset = state.num_chars
        for lp in item.logprobs or ():
            state.text_offsets.append(min(offset, end))
            offset += len(self._frontend.tokenizer.token_text(lp.token_id))
        if item.prompt_logprobs is not None:
            state.prompt_logprobs = item.prompt_logprobs
        state.texts.append(item.text)
        state.logprobs.extend(item.logprobs or ())
        state.num_chars = end
        state.num_tokens += len(item.token_ids)
        return item

    async def _send_chunk(self, send: Send, chunk: Chunk, state: ChoiceState) -> None:
        if isinstance(chunk, BaseModel):
            await self._send_body(send, self._format.encode_event(self._with_usage(chunk, state)))
            return
        # Several events (the Responses API's opening ones): one send, so they leave together.
        await self._send_body(send, b"".join(self._format.encode_event(event) for event in chunk))

    def _with_usage(self, chunk: BaseModel, state: ChoiceState) -> BaseModel:
        """With ``continuous_usage_stats``: the chunk carries its choice's usage so far (vLLM
        counts the prompt and that choice's tokens)."""
        if self._job.include_continuous_usage:
            num_prompt_tokens = len(state.prompt_token_ids)
            chunk.usage = UsageInfo(  # type: ignore[attr-defined]
                prompt_tokens=num_prompt_tokens,
                completion_tokens=state.num_tokens,
                total_tokens=num_prompt_tokens + state.num_tokens,
            )
        return chunk

    def _usage(self, states: Sequence[ChoiceState]) -> UsageInfo:
        # Per prompt: its tokens count once (as OpenAI counts), the best cache hit among its
        # choices; completion tokens add up over every choice.
        num_prompt_tokens = num_cached = num_completion = 0
        for first in range(0, len(states), self._n):
            group = states[first : first + self._n]
            num_prompt_tokens += len(group[0].prompt_token_ids)
            num_cached += max(
                (s.finished.usage.cached_prompt_tokens for s in group if s.finished), default=0
            )
            num_completion += sum(s.finished.usage.completion_tokens for s in group if s.finished)
        return UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion,
            total_tokens=num_prompt_tokens + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
        )

    async def _send_body(self, send: Send, body: bytes) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": True})

    async def _send_json(
        self,
        send: Send,
        status: int,
        body: BaseModel | dict[str, object],
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self._is_started = True
        await send_json(
            send, status, body, [(b"x-request-id", self._job.request_id.encode()), *(headers or [])]
        )
