"""A Responses API request's one chat choice as OpenAI answers it: a response object, or streamed
as its events

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta (one per piece of text),
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed (or response.incomplete at max_output_tokens)

each with its ``sequence_number``, as ``event: <type>`` and ``data: <json>`` lines (no
``[DONE]``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from gateway.errors import GatewayError
from gateway.http_api.openai_format import ChoiceState, OpenAIFormat
from gateway.http_api.openai_job import OpenAIJob
from gateway.http_api.openai_protocol import UsageInfo
from gateway.http_api.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)
from gateway.text.text_stream import TextDelta
from gateway.text.tokenizer import Tokenizer
from services.types import FinishReason


class ResponsesFormat(OpenAIFormat):
    """A chat completion's one choice as a response object or its stream of events."""

    ends_with_done = False

    def __init__(
        self,
        job: OpenAIJob,
        tokenizer: Tokenizer,
        model: str,
        body: ResponsesRequest,
        on_end: Callable[[ResponseObject, str], None] | None = None,
        response_id: str | None = None,
    ) -> None:
        """``on_end``: given the final response object and its output text once the response
        ends (it stores them); None: the response is not stored. ``response_id``: the
        response's id (default: the job's request id)."""
        super().__init__(job, tokenizer, model)
        self._body = body
        self._response_id = job.request_id if response_id is None else response_id
        self._on_end = on_end
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._sequence = 0

    def encode_event(self, payload: BaseModel | dict[str, Any]) -> bytes:
        """``event: <type>`` before the data line, as OpenAI streams a response."""
        kind = payload.get("type") if isinstance(payload, dict) else None
        prefix = b"" if kind is None else b"event: " + str(kind).encode() + b"\n"
        return prefix + super().encode_event(payload)

    def delta_chunk(self, state: ChoiceState, delta: TextDelta) -> list[dict[str, Any]] | None:
        if not delta.text:
            return None
        events = [] if state.is_started else self._opening_events(state)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self._message_id,
                output_index=0,
                content_index=0,
                delta=delta.text,
                logprobs=[],
            )
        )
        return events

    def finish_chunk(self, state: ChoiceState) -> list[dict[str, Any]]:
        # A response without text still opens its message before closing it.
        events = [] if state.is_started else self._opening_events(state)
        final = self._ended(state)
        text = "".join(state.texts)
        where = {"item_id": self._message_id, "output_index": 0, "content_index": 0}
        events += [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event(
                "response.content_part.done", **where, part=OutputText(text=text).model_dump()
            ),
            self._event(
                "response.output_item.done", output_index=0, item=final.output[0].model_dump()
            ),
            self._event(f"response.{final.status}", response=final.model_dump()),
        ]
        return events

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        raise AssertionError("a Responses stream carries its usage in its last event")

    def error_event(self, error: GatewayError) -> dict[str, Any]:
        """The Responses API's ``error`` event, after ``response.failed``: the SDK yields it as
        an event (the chat routes' ``{"error": ...}`` body makes it raise, so that a client
        collecting the stream's events got an exception in place of them)."""
        return self._event(
            "error", code=error.kind.openai_type, message=error.message, param=error.param
        )

    def response(self, states: Sequence[ChoiceState], usage: UsageInfo) -> BaseModel:
        (state,) = states
        return self._ended(state)

    def _ended(self, state: ChoiceState) -> ResponseObject:
        """The final response object, stored first (where it is to be)."""
        final = self._response(state, self._status(state))
        if self._on_end is not None:
            self._on_end(final, "".join(state.texts))
        return final

    def _opening_events(self, state: ChoiceState) -> list[dict[str, Any]]:
        opened = self._response(state, "in_progress").model_dump()
        return [
            self._event("response.created", response=opened),
            self._event("response.in_progress", response=opened),
            self._event(
                "response.output_item.added",
                output_index=0,
                item=OutputMessage(
                    id=self._message_id, status="in_progress", content=[]
                ).model_dump(),
            ),
            self._event(
                "response.content_part.added",
                item_id=self._message_id,
                output_index=0,
                content_index=0,
                part=OutputText(text="").model_dump(),
            ),
        ]

    def _status(self, state: ChoiceState) -> ResponseStatus:
        assert state.finished is not None
        return _STATUS.get(state.finished.finish_reason, "completed")

    def _response(self, state: ChoiceState, status: ResponseStatus) -> ResponseObject:
        """The response object as it stands: no output or usage while in progress."""
        body, finished = self._body, state.finished
        output, usage = [], None
        if status != "in_progress" and finished is not None:
            text = OutputText(text="".join(state.texts))
            output = [
                OutputMessage(
                    id=self._message_id,
                    status="incomplete" if status == "incomplete" else "completed",
                    content=[text],
                )
            ]
            prompt, completion = len(state.prompt_token_ids), finished.usage.completion_tokens
            usage = ResponseUsage(
                input_tokens=prompt,
                input_tokens_details=InputTokensDetails(
                    cached_tokens=finished.usage.cached_prompt_tokens
                ),
                output_tokens=completion,
                total_tokens=prompt + completion,
            )
        text_format = None if body.text is None else body.text.format
        return ResponseObject(
            id=self._response_id,
            created_at=self.job.created,
            status=status,
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            ),
            error=(
                ResponseError(
                    code="invalid_prompt" if finished.invalid_request else "server_error",
                    message=finished.error or "generation failed",
                )
                if status == "failed" and finished is not None
                else None
            ),
            model=self.model,
            output=output,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            text={
                "format": {"type": "text"}
                if text_format is None
                else text_format.model_dump(by_alias=True, exclude_none=True)
            },
            metadata=body.metadata or {},
            usage=usage,
            previous_response_id=body.previous_response_id,
            store=self._on_end is not None,
        )

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


_STATUS: dict[FinishReason, ResponseStatus] = {
    FinishReason.LENGTH: "incomplete",
    FinishReason.ERROR: "failed",
    FinishReason.ABORT: "cancelled",
}
