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
from gateway.http_api.response_store import Message
from gateway.http_api.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
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
from gateway.tool_calls import ToolCallStream
from gateway.tool_parsers import make_parser
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
        on_end: Callable[[ResponseObject, Message], None] | None = None,
        response_id: str | None = None,
    ) -> None:
        """``on_end``: given the final response object and its output as an assistant chat
        message once the response ends (it stores them); None: the response is not stored.
        ``response_id``: the response's id (default: the job's request id)."""
        super().__init__(job, tokenizer, model)
        self._body = body
        self._on_end = on_end
        self._response_id = job.request_id if response_id is None else response_id
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._sequence = 0
        self._is_opened = False
        """response.created and response.in_progress went out."""
        self._is_message_open = False
        """The message item and its text part were added (the first text went out)."""
        # With function tools, the text goes through the tool-call parser: content is streamed
        # as it comes, the calls are items once the choice ends (tool_calls.py).
        self._tools: ToolCallStream | None = None
        if job.tools is not None:
            parser = make_parser(job.tool_call_parser, tokenizer.backend.token_to_id)
            self._tools = ToolCallStream(job.tools, parser)
        self._is_fed = False
        self._output: tuple[str | None, list[OutputFunctionCall]] | None = None

    def encode_event(self, payload: BaseModel | dict[str, Any]) -> bytes:
        """``event: <type>`` before the data line, as OpenAI streams a response."""
        kind = payload.get("type") if isinstance(payload, dict) else None
        prefix = b"" if kind is None else b"event: " + str(kind).encode() + b"\n"
        return prefix + super().encode_event(payload)

    def delta_chunk(self, state: ChoiceState, delta: TextDelta) -> list[dict[str, Any]] | None:
        text: str | None = delta.text
        if self._tools is not None:
            self._is_fed = True
            text, _ = self._tools.feed(delta.text)
        if not text:
            return None
        return [*self._open(state), *self._open_message(), self._text_delta(text)]

    def finish_chunk(self, state: ChoiceState) -> list[dict[str, Any]]:
        events = self._open(state)
        rest = None
        if self._tools is not None:
            self._is_fed = True
            rest, _ = self._tools.finish()
        if rest:
            events += [*self._open_message(), self._text_delta(rest)]
        final = self._ended(state)
        for index, item in enumerate(final.output):
            if isinstance(item, OutputMessage):
                # A response without text or calls still opens its message before closing it.
                events += self._open_message()
                text = item.content[0].text
                where = {"item_id": item.id, "output_index": index, "content_index": 0}
                events += [
                    self._event("response.output_text.done", **where, text=text, logprobs=[]),
                    self._event(
                        "response.content_part.done", **where, part=item.content[0].model_dump()
                    ),
                ]
            else:
                opened = item.model_copy(update={"arguments": "", "status": "in_progress"})
                where = {"item_id": item.id, "output_index": index}
                events += [
                    self._event(
                        "response.output_item.added", output_index=index, item=opened.model_dump()
                    ),
                    self._event(
                        "response.function_call_arguments.delta", **where, delta=item.arguments
                    ),
                    self._event(
                        "response.function_call_arguments.done", **where, arguments=item.arguments
                    ),
                ]
            events.append(
                self._event("response.output_item.done", output_index=index, item=item.model_dump())
            )
        events.append(self._event(f"response.{final.status}", response=final.model_dump()))
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
            text, calls = self._parsed(state)
            reply: Message = {"role": "assistant", "content": text}
            if calls:
                reply["tool_calls"] = [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in calls
                ]
            self._on_end(final, reply)
        return final

    def _parsed(self, state: ChoiceState) -> tuple[str | None, list[OutputFunctionCall]]:
        """The ended choice's text (None: only calls) and its function calls."""
        if self._output is None:
            tools, text = self._tools, "".join(state.texts)
            if tools is None:
                self._output = text, []
            else:
                if not self._is_fed:  # a whole response: the text at once
                    tools.feed(text)
                    tools.finish()
                content, calls = tools.result()
                items = [
                    OutputFunctionCall(
                        id=f"fc_{uuid.uuid4().hex}",
                        call_id=call.id,
                        name=call.function.name,
                        arguments=call.function.arguments,
                    )
                    for call in calls or ()
                ]
                self._output = content, items
        return self._output

    def _open(self, state: ChoiceState) -> list[dict[str, Any]]:
        if self._is_opened:
            return []
        self._is_opened = True
        opened = self._response(state, "in_progress").model_dump()
        return [
            self._event("response.created", response=opened),
            self._event("response.in_progress", response=opened),
        ]

    def _open_message(self) -> list[dict[str, Any]]:
        if self._is_message_open:
            return []
        self._is_message_open = True
        return [
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

    def _text_delta(self, text: str) -> dict[str, Any]:
        return self._event(
            "response.output_text.delta",
            item_id=self._message_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _status(self, state: ChoiceState) -> ResponseStatus:
        assert state.finished is not None
        return _STATUS.get(state.finished.finish_reason, "completed")

    def _response(self, state: ChoiceState, status: ResponseStatus) -> ResponseObject:
        """The response object as it stands: no output or usage while in progress. The output
        is the message (where there is text, or nothing else), then the function calls."""
        body, finished = self._body, state.finished
        output: list[OutputMessage | OutputFunctionCall] = []
        usage = None
        if status != "in_progress" and finished is not None:
            text, calls = self._parsed(state)
            if text or not calls:
                output.append(
                    OutputMessage(
                        id=self._message_id,
                        status="incomplete" if status == "incomplete" else "completed",
                        content=[OutputText(text=text or "")],
                    )
                )
            output += calls
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
        choice = body.tool_choice
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
            parallel_tool_calls=body.parallel_tool_calls is not False,
            tool_choice=(
                "auto"
                if choice is None
                else choice
                if isinstance(choice, str)
                else choice.model_dump()
            ),
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or ()],
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
