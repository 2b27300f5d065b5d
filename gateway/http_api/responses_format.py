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

from gateway.chat_output import ChatOutput, ChatPiece
from gateway.errors import GatewayError
from gateway.http_api.openai_format import ChoiceState, OpenAIFormat
from gateway.http_api.openai_job import OpenAIJob
from gateway.http_api.openai_protocol import TokenLogprobInfo, UsageInfo
from gateway.http_api.response_store import Message
from gateway.http_api.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
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
        self._reasoning_id = f"rs_{uuid.uuid4().hex}"
        self._sequence = 0
        self._is_opened = False
        """response.created and response.in_progress went out."""
        self._is_reasoning_open = False
        """The reasoning item was added (the first reasoning text went out)."""
        self._is_reasoning_done = False
        self._is_message_open = False
        """The message item and its text part were added (the first answer text went out)."""
        # The text goes through the reasoning parser (a thinking model's block, with
        # --reasoning-parser) and the tool-call parser (with function tools), as the chat
        # route's: reasoning and content stream as they come, the calls are items at the end.
        tools = None
        if job.tools is not None:
            parser = make_parser(job.tool_call_parser, tokenizer.backend.token_to_id)
            tools = ToolCallStream(job.tools, parser)
        self._chat = ChatOutput(job.reasoning, tools)
        self._is_fed = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._pending_logprobs: list[TokenLogprobInfo] = []
        """With logprobs asked for: those of tokens whose text has not gone out yet."""
        self._output: list[OutputReasoning | OutputMessage | OutputFunctionCall] | None = None

    def encode_event(self, payload: BaseModel | dict[str, Any]) -> bytes:
        """``event: <type>`` before the data line, as OpenAI streams a response."""
        kind = payload.get("type") if isinstance(payload, dict) else None
        prefix = b"" if kind is None else b"event: " + str(kind).encode() + b"\n"
        return prefix + super().encode_event(payload)

    def delta_chunk(self, state: ChoiceState, delta: TextDelta) -> list[dict[str, Any]] | None:
        self._is_fed = True
        if self.job.num_logprobs is not None:
            # Sent with the next text: a token may end in the middle of a character.
            self._pending_logprobs += self.token_logprobs(delta.logprobs or ())
        events = self._piece_events(state, self._chat.feed(delta.text))
        return events or None

    def finish_chunk(self, state: ChoiceState) -> list[dict[str, Any]]:
        self._is_fed = True
        events = self._open(state) + self._piece_events(state, self._chat.finish())
        final = self._ended(state)
        for index, item in enumerate(final.output):
            if isinstance(item, OutputReasoning):
                events += self._close_reasoning(item, index)
                continue
            if isinstance(item, OutputMessage):
                # A response without text or calls still opens its message before closing it.
                events += self._open_message()
                text = item.content[0].text
                where = {"item_id": item.id, "output_index": index, "content_index": 0}
                logprobs = [lp.model_dump() for lp in item.content[0].logprobs]
                events += [
                    self._event("response.output_text.done", **where, text=text, logprobs=logprobs),
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

    def _piece_events(self, state: ChoiceState, piece: ChatPiece) -> list[dict[str, Any]]:
        """The events of one parsed piece of text: its reasoning, then its content (the calls
        are items once the choice ends)."""
        events: list[dict[str, Any]] = []
        if piece.reasoning:
            self._reasoning.append(piece.reasoning)
            events += self._open(state)
            if not self._is_reasoning_open:
                self._is_reasoning_open = True
                events += self._reasoning_opening()
            where = {"item_id": self._reasoning_id, "output_index": 0, "content_index": 0}
            events.append(
                self._event("response.reasoning_text.delta", **where, delta=piece.reasoning)
            )
        if piece.content:
            self._content.append(piece.content)
            events += self._open(state)
            if self._is_reasoning_open and not self._is_reasoning_done:
                events += self._close_reasoning(self._reasoning_item(), 0)
            events += [*self._open_message(), self._text_delta(piece.content)]
        return events

    def _reasoning_item(self) -> OutputReasoning:
        return OutputReasoning(
            id=self._reasoning_id, content=[ReasoningText(text="".join(self._reasoning))]
        )

    def _reasoning_opening(self) -> list[dict[str, Any]]:
        opened = OutputReasoning(id=self._reasoning_id, content=[], status="in_progress")
        return [
            self._event("response.output_item.added", output_index=0, item=opened.model_dump()),
            self._event(
                "response.content_part.added",
                item_id=self._reasoning_id,
                output_index=0,
                content_index=0,
                part=ReasoningText(text="").model_dump(),
            ),
        ]

    def _close_reasoning(self, item: OutputReasoning, index: int) -> list[dict[str, Any]]:
        """The reasoning item's closing events, once (when the answer starts, or at the end)."""
        if self._is_reasoning_done:
            return []
        self._is_reasoning_done = True
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        part = item.content[0]
        return [
            self._event("response.reasoning_text.done", **where, text=part.text),
            self._event("response.content_part.done", **where, part=part.model_dump()),
            self._event("response.output_item.done", output_index=index, item=item.model_dump()),
        ]

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
            # The answer alone: a thinking model's templates drop earlier turns' reasoning.
            content = "".join(self._content) or None
            reply: Message = {"role": "assistant", "content": content}
            calls = [item for item in final.output if isinstance(item, OutputFunctionCall)]
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

    def _parsed(
        self, state: ChoiceState, status: ResponseStatus
    ) -> list[OutputReasoning | OutputMessage | OutputFunctionCall]:
        """The ended choice's output items: its reasoning (where there is any), its message
        (where there is text, or nothing else), then its function calls."""
        if self._output is None:
            if not self._is_fed:  # a whole response: the text at once
                for piece in (self._chat.feed("".join(state.texts)), self._chat.finish()):
                    self._reasoning += [piece.reasoning] if piece.reasoning else []
                    self._content += [piece.content] if piece.content else []
            output: list[OutputReasoning | OutputMessage | OutputFunctionCall] = []
            if self._reasoning:
                output.append(self._reasoning_item())
            calls = [
                OutputFunctionCall(
                    id=f"fc_{uuid.uuid4().hex}",
                    call_id=call.id,
                    name=call.function.name,
                    arguments=call.function.arguments,
                )
                for call in self._chat.tool_calls
            ]
            text = "".join(self._content)
            if text or not calls:
                logprobs = (
                    [] if self.job.num_logprobs is None else self.token_logprobs(state.logprobs)
                )
                output.append(
                    OutputMessage(
                        id=self._message_id,
                        status="incomplete" if status == "incomplete" else "completed",
                        content=[OutputText(text=text, logprobs=logprobs)],
                    )
                )
            self._output = [*output, *calls]
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
        index = self._message_index
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=OutputMessage(
                    id=self._message_id, status="in_progress", content=[]
                ).model_dump(),
            ),
            self._event(
                "response.content_part.added",
                item_id=self._message_id,
                output_index=index,
                content_index=0,
                part=OutputText(text="").model_dump(),
            ),
        ]

    @property
    def _message_index(self) -> int:
        """The message's place in the output: after the reasoning, where there is any."""
        return 1 if self._reasoning else 0

    def _text_delta(self, text: str) -> dict[str, Any]:
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        return self._event(
            "response.output_text.delta",
            item_id=self._message_id,
            output_index=self._message_index,
            content_index=0,
            delta=text,
            logprobs=[lp.model_dump() for lp in logprobs],
        )

    def _status(self, state: ChoiceState) -> ResponseStatus:
        assert state.finished is not None
        return _STATUS.get(state.finished.finish_reason, "completed")

    def _response(self, state: ChoiceState, status: ResponseStatus) -> ResponseObject:
        """The response object as it stands: no output or usage while in progress."""
        body, finished = self._body, state.finished
        output: list[OutputReasoning | OutputMessage | OutputFunctionCall] = []
        usage = None
        if status != "in_progress" and finished is not None:
            output = self._parsed(state, status)
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
            reasoning=None if body.reasoning is None else body.reasoning.model_dump(),
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
