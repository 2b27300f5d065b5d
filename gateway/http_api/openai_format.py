"""The OpenAI output formats of ``/v1/completions`` and ``/v1/chat/completions``: chunks (SSE)
and whole responses, rendered from the ``ChoiceState`` each choice accumulates. The Responses
API's format (``responses_format.py``) derives from the same base.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import BaseModel

from gateway.chat_output import ChatOutput
from gateway.errors import GatewayError, invalid_from
from gateway.http_api.openai_job import OpenAIJob
from gateway.http_api.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FinishReasonName,
    PromptLogprob,
    PromptLogprobs,
    Role,
    TokenLogprobInfo,
    TopLogprob,
    UsageInfo,
)
from gateway.http_api.sse import sse_event
from gateway.reasoning import split_reasoning
from gateway.text.text_stream import TextDelta, TextFinished
from gateway.text.tokenizer import Tokenizer
from gateway.tool_calls import ToolCallStream
from gateway.tool_parsers import make_parser
from services.chat_template import ChatRequestError, message_text
from services.types import TokenLogprob

# OpenAI's stand-in for a logprob of -inf: JSON has no infinities.
_MIN_LOGPROB = -9999.0


@dataclass
class ChoiceState:
    index: int
    prompt_token_ids: tuple[int, ...]
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    """Where each of ``logprobs``' tokens starts in the generated text (``texts`` joined)."""
    num_echo_chars: int = 0
    """Characters of the echoed prompt that the choice's text starts with (completions with
    ``echo``), set with its first chunk: its legacy text offsets count them too."""
    num_chars: int = 0
    num_tokens: int = 0
    is_started: bool = False
    """A chunk of this choice went out (chat: the role was sent)."""
    finished: TextFinished | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """Prompt tokens 1, 2, ...'s, from the first delta, when the request asked for them."""


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def _top_with_token(lp: TokenLogprob, num_top: int) -> tuple[tuple[int, float], ...]:
    """The legacy ``top_logprobs`` of a token: its top ``num_top`` and the token itself, so up
    to ``num_top`` + 1 (OpenAI's, vLLM's). The nodes may have sent more alternatives (an echoed
    prompt's are asked for ``max(logprobs, prompt_logprobs)``)."""
    top = lp.top[:num_top]
    if all(token_id != lp.token_id for token_id, _ in top):
        top += ((lp.token_id, lp.logprob),)  # below the others: lp.top is best first
    return top


Chunk = BaseModel | list[dict[str, Any]]
"""What one step of a stream sends: a chunk, or several events (the Responses API's)."""


class OpenAIFormat:
    """How one API shapes chunks and responses; one subclass per route."""

    ends_with_done = True
    """The stream ends with ``data: [DONE]`` (completions and chat; not the Responses API)."""

    def __init__(self, job: OpenAIJob, tokenizer: Tokenizer, model: str) -> None:
        self.job = job
        self.tokenizer = tokenizer
        self.model = model

    def encode_event(self, payload: BaseModel | dict[str, Any]) -> bytes:
        """One chunk or event as the stream's SSE bytes. A chunk carries ``usage`` only with
        ``stream_options.include_usage`` (null until the usage chunk), as OpenAI sends it; a
        field every chunk sent as null could fail a client's strict schema for nothing."""
        return sse_event(payload, None if self.job.include_usage else {"usage"})

    def token_text(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or vLLM's ``token_id:<id>`` with
        ``return_tokens_as_token_ids`` (a token that is a byte of a multi-byte character has no
        text of its own, so a client cannot tell such tokens apart by text)."""
        if self.job.body.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The chat logprobs' ``bytes``: the token's, or those of ``token_text`` (as vLLM)."""
        if self.job.body.return_tokens_as_token_ids:
            return self.token_text(token_id).encode()
        return self.tokenizer.token_bytes(token_id)

    def delta_chunk(self, state: ChoiceState, delta: TextDelta) -> Chunk | None:
        raise NotImplementedError

    def finish_chunk(self, state: ChoiceState) -> Chunk:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def error_event(self, error: GatewayError) -> dict[str, Any]:
        """The event a stream that failed after it began ends with: the error body itself
        (completions and chat), which the OpenAI SDK raises as an ``APIError``."""
        return error.openai_body()

    def response(self, states: Sequence[ChoiceState], usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def token_logprobs(self, logprobs: Sequence[TokenLogprob]) -> list[TokenLogprobInfo]:
        """Each token's logprob and its top alternatives in OpenAI's chat (and Responses)
        shape: the token's text and UTF-8 bytes."""

        def top(token_id: int, logprob: float) -> TopLogprob:
            return TopLogprob(
                token=self.token_text(token_id),
                logprob=_finite(logprob),
                bytes=list(self.token_bytes(token_id)),
            )

        # OpenAI's top_logprobs: exactly the top n asked for; lp.top also holds the sampled
        # token when it is not among them (the legacy format's n + 1).
        num_top = self.job.num_logprobs or 0
        return [
            TokenLogprobInfo(
                **top(lp.token_id, lp.logprob).model_dump(),
                top_logprobs=[top(t, lp_) for t, lp_ in lp.top[:num_top]],
            )
            for lp in logprobs
        ]

    def has_logprobs(self, delta: TextDelta) -> bool:
        return self.job.num_logprobs is not None and bool(delta.token_ids) and bool(delta.logprobs)

    def prompt_logprobs(self, state: ChoiceState) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` field: None unless the request set ``prompt_logprobs``."""
        num_top = self.job.body.prompt_logprobs
        if num_top is None:
            return None
        text = self.token_text
        entries: PromptLogprobs = [None]
        for lp in state.prompt_logprobs or ():
            # vLLM's: the top-n ranked by their place, the prompt's token by its rank in the
            # whole vocabulary (the node's; from a node without ranks, its place or None).
            ranked = {
                token_id: PromptLogprob(
                    logprob=_finite(value), rank=place, decoded_token=text(token_id)
                )
                for place, (token_id, value) in enumerate(lp.top[:num_top], start=1)
            }
            own = ranked.get(lp.token_id)
            rank = lp.rank if lp.rank is not None else own.rank if own is not None else None
            ranked[lp.token_id] = PromptLogprob(
                logprob=_finite(lp.logprob), rank=rank, decoded_token=text(lp.token_id)
            )
            entries.append(ranked)
        return entries


class CompletionFormat(OpenAIFormat):
    def legacy_logprobs(
        self, logprobs: Sequence[TokenLogprob], offsets: Sequence[int]
    ) -> CompletionLogprobs:
        """The choice's own tokens' logprobs; ``offsets``: where each starts in the choice's
        text, an echoed prompt included."""
        text = self.token_text
        num_top = self.job.num_logprobs or 0
        return CompletionLogprobs(
            tokens=[text(lp.token_id) for lp in logprobs],
            token_logprobs=[_finite(lp.logprob) for lp in logprobs],
            top_logprobs=[
                {text(t): _finite(v) for t, v in _top_with_token(lp, num_top)} for lp in logprobs
            ],
            text_offset=list(offsets),
        )

    def echo_logprobs(self, state: ChoiceState) -> CompletionLogprobs | None:
        """With ``echo`` and ``logprobs``: the legacy logprobs of the echoed prompt's tokens (the
        first has none), which the choice's own tokens' follow; their offsets count the token
        texts from 0."""
        body = self.job.body
        num_top = self.job.num_logprobs
        if not getattr(body, "echo", False) or num_top is None:
            return None
        text = self.token_text
        prompt = state.prompt_token_ids
        known = {lp_index + 1: lp for lp_index, lp in enumerate(state.prompt_logprobs or ())}
        logprobs = CompletionLogprobs()
        offset = 0
        for position, token_id in enumerate(prompt):
            lp = known.get(position)
            token = text(token_id)
            logprobs.tokens.append(token)
            logprobs.token_logprobs.append(None if lp is None else _finite(lp.logprob))
            logprobs.top_logprobs.append(
                None
                if lp is None
                else {text(t): _finite(v) for t, v in _top_with_token(lp, num_top)}
            )
            logprobs.text_offset.append(offset)
            offset += len(self.tokenizer.token_text(token_id))  # offsets index the text
        return logprobs

    def with_echo_logprobs(
        self, state: ChoiceState, logprobs: CompletionLogprobs | None
    ) -> CompletionLogprobs | None:
        """``logprobs`` (the choice's own tokens', offsets already past the echoed text) after
        the echoed prompt's, when echoed."""
        echoed = self.echo_logprobs(state)
        if echoed is None:
            return logprobs
        if logprobs is not None:
            echoed.tokens += logprobs.tokens
            echoed.token_logprobs += logprobs.token_logprobs
            echoed.top_logprobs += logprobs.top_logprobs
            echoed.text_offset += logprobs.text_offset
        return echoed

    def echo_text(self, state: ChoiceState) -> str:
        """With ``echo``: the choice's prompt, which its text starts with; else nothing."""
        body = self.job.body
        if not getattr(body, "echo", False):
            return ""
        prompt = body.prompt  # type: ignore[union-attr]
        if self.job.prompt_tokens_kept is not None:  # truncated: the text of what was kept
            return self.tokenizer.decode(state.prompt_token_ids, body.skip_special_tokens)
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            return prompt[state.index // body.n]  # type: ignore[return-value]
        return self.tokenizer.decode(state.prompt_token_ids, body.skip_special_tokens)

    def delta_chunk(self, state: ChoiceState, delta: TextDelta) -> BaseModel | None:
        if not delta.text and not self.has_logprobs(delta):
            return None
        echo = ""
        if not state.is_started:
            echo = self.echo_text(state)
            state.num_echo_chars = len(echo)
        logprobs = None
        if self.has_logprobs(delta):
            num_tokens = len(delta.logprobs or ())
            # Offsets into the whole choice text, as the response's: past the echoed prompt.
            offsets = [state.num_echo_chars + o for o in state.text_offsets[-num_tokens:]]
            logprobs = self.legacy_logprobs(delta.logprobs or (), offsets)
        if state.is_started:
            return self._chunk(
                CompletionChoice(index=state.index, text=delta.text, logprobs=logprobs)
            )
        # The choice's first chunk: the echoed prompt (and its logprobs), vLLM's prompt_logprobs.
        return self._chunk(
            CompletionChoice(
                index=state.index,
                text=echo + delta.text,
                logprobs=self.with_echo_logprobs(state, logprobs),
                prompt_logprobs=self.prompt_logprobs(state),
            )
        )

    def finish_chunk(self, state: ChoiceState) -> BaseModel:
        assert state.finished is not None
        return self._chunk(
            CompletionChoice(
                index=state.index,
                text="" if state.is_started else self.echo_text(state),
                finish_reason=state.finished.finish_reason.value,
                stop_reason=state.finished.stop_reason,
            )
        )

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return CompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.model, choices=[],
            usage=usage,
        )  # fmt: skip

    def _chunk(self, choice: CompletionChoice) -> CompletionResponse:
        return CompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.model, choices=[choice]
        )

    def response(self, states: Sequence[ChoiceState], usage: UsageInfo) -> BaseModel:
        choices = []
        for state in states:
            assert state.finished is not None
            echo = self.echo_text(state)
            logprobs = None
            if self.job.num_logprobs is not None:
                offsets = [len(echo) + offset for offset in state.text_offsets]
                logprobs = self.legacy_logprobs(state.logprobs, offsets)
            choices.append(
                CompletionChoice(
                    index=state.index,
                    text=echo + "".join(state.texts),
                    logprobs=self.with_echo_logprobs(state, logprobs),
                    prompt_logprobs=self.prompt_logprobs(state),
                    finish_reason=state.finished.finish_reason.value,
                    stop_reason=state.finished.stop_reason,
                )
            )
        return CompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.model, choices=choices,
            usage=usage,
        )  # fmt: skip


class ChatFormat(OpenAIFormat):
    def chat_logprobs(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=self.token_logprobs(logprobs))

    def __init__(self, job: OpenAIJob, tokenizer: Tokenizer, model: str) -> None:
        super().__init__(job, tokenizer, model)
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._outputs: dict[int, ChatOutput] = {}
        body = job.body
        assert isinstance(body, ChatCompletionRequest)
        last = body.messages[-1]
        # vLLM's rule: without the generation prompt the model writes on in the last message's
        # voice, so the response takes its role.
        self._role: Role = "assistant" if body.add_generation_prompt else last.role
        # With echo: the last message's text, which each choice's content starts with, when
        # that message has the response's role (vLLM's rule).
        self._echo = ""
        if body.echo and last.role == self._role:
            # The text the template was given for it.
            content = last.model_dump()["content"]
            try:
                self._echo = message_text(len(body.messages) - 1, last.role, content)
            except ChatRequestError as exc:
                raise invalid_from(exc) from None

    def tool_stream(self, state: ChoiceState) -> ToolCallStream | None:
        """The choice's text → tool calls, when the request has tools."""
        if self.job.tools is None:
            return None
        stream = self._tool_streams.get(state.index)
        if stream is None:
            parser = make_parser(self.job.tool_call_parser, self.tokenizer.backend.token_to_id)
            stream = self._tool_streams[state.index] = ToolCallStream(self.job.tools, parser)
        return stream

    def output(self, state: ChoiceState) -> ChatOutput:
        """The streamed choice's text → reasoning, content and tool call deltas."""
        output = self._outputs.get(state.index)
        if output is None:
            output = ChatOutput(self.job.reasoning, self.tool_stream(state))
            self._outputs[state.index] = output
        return output

    def _reasoning_field(self, reasoning: str | None) -> str | None:
        """``reasoning_content`` as sent: None when empty or not asked for."""
        body = self.job.body
        assert isinstance(body, ChatCompletionRequest)
        return reasoning if reasoning and body.include_reasoning else None

    def delta_chunk(self, state: ChoiceState, delta: TextDelta) -> BaseModel | None:
        piece = self.output(state).feed(delta.text)
        reasoning = self._reasoning_field(piece.reasoning)
        content, tool_calls = piece.content, piece.tool_calls
        # The first chunk of a choice carries the role with its first content, so a client's
        # TTFT is measured at a real token.
        if (
            state.is_started
            and not content
            and not reasoning
            and not tool_calls
            and not self.has_logprobs(delta)
        ):
            return None
        if not state.is_started and self._echo:
            content = self._echo + (content or "")
        logprobs = self.chat_logprobs(delta.logprobs or ()) if self.has_logprobs(delta) else None
        choice = ChatChunkChoice(
            index=state.index,
            delta=ChatDelta(
                role=None if state.is_started else self._role,
                reasoning_content=reasoning,
                content=content if content or not (tool_calls or reasoning) else None,
                tool_calls=tool_calls or None,
            ),
            logprobs=logprobs,
        )
        return self._chunk([choice])

    def finish_chunk(self, state: ChoiceState) -> BaseModel:
        assert state.finished is not None
        delta = ChatDelta() if state.is_started else ChatDelta(role=self._role, content=self._echo)
        # What the parsers held back (a tail that might have begun a tag or a call's marker),
        # and the calls parsed whole.
        piece = self.output(state).finish()
        delta.reasoning_content = self._reasoning_field(piece.reasoning)
        delta.tool_calls = piece.tool_calls or None
        if piece.content:
            delta.content = (delta.content or "") + piece.content
        tools = self.tool_stream(state)
        return self._chunk(
            [
                ChatChunkChoice(
                    index=state.index,
                    delta=delta,
                    finish_reason=self._finish_reason(state, tools),
                    stop_reason=state.finished.stop_reason,
                )
            ]
        )

    def _finish_reason(self, state: ChoiceState, tools: ToolCallStream | None) -> FinishReasonName:
        """``tool_calls`` when the model stopped after calling tools (OpenAI keeps ``stop`` for
        a named function)."""
        assert state.finished is not None
        reason = state.finished.finish_reason.value
        if reason == "stop" and tools is not None and tools.calls and not tools.is_named:
            return "tool_calls"
        # Each FinishReason value is a FinishReasonName (tests/gateway/test_openai_protocol.py).
        return cast(FinishReasonName, reason)

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        chunk = self._chunk([])
        chunk.usage = usage
        return chunk

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.job.request_id, created=self.job.created, model=self.model, choices=choices
        )

    def response(self, states: Sequence[ChoiceState], usage: UsageInfo) -> BaseModel:
        choices = []
        for state in states:
            assert state.finished is not None
            logprobs = None
            if self.job.num_logprobs is not None:
                logprobs = self.chat_logprobs(state.logprobs)
            content: str | None = "".join(state.texts)
            reasoning = None
            if self.job.reasoning is not None:
                reasoning, content = split_reasoning(self.job.reasoning, content or "")
                reasoning = self._reasoning_field(reasoning)
            tool_calls = None
            tools = self.tool_stream(state)
            if tools is not None:
                tools.feed(content or "")
                tools.finish()
                content, tool_calls = tools.result()
            if self._echo:
                content = self._echo + (content or "")
            choices.append(
                ChatChoice(
                    index=state.index,
                    message=ChatResponseMessage(
                        role=self._role,
                        reasoning_content=reasoning,
                        content=content,
                        tool_calls=tool_calls,
                    ),
                    logprobs=logprobs,
                    finish_reason=self._finish_reason(state, tools),
                    stop_reason=state.finished.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.model, choices=choices,
            usage=usage, prompt_logprobs=self.prompt_logprobs(states[0]),
        )  # fmt: skip
