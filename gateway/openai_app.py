"""The OpenAI-compatible HTTP/SSE front end: ``build_openai_app(frontend) -> FastAPI``.

Life of one ``/v1/completions`` or ``/v1/chat/completions`` request here:

1. ``_Gate`` (ASGI middleware): arrival time; the API key on ``/v1/*`` (401); the body read whole
   and bounded by ``limits.max_body_bytes``, by Content-Length and by the bytes themselves (413).
2. FastAPI parses the body into the strict request model; any mismatch is a 400 naming the field.
3. The route checks what needs no tokenizer (model name, unsupported features, limits) into a
   ``_Job`` and returns a ``_GenerationResponse``, which owns everything after:
4. while a task watches the ASGI receive channel for the client's disconnect: an admission slot
   (429) → tokenization and length checks (400) → one generation per choice, all started at once
   → each choice's first event (a ``GatewayError`` here is the response's status, also when
   streaming) → SSE chunks as tokens arrive, or one JSON body at the end.
5. A disconnect at any point cancels step 4; closing each choice's event iterator is what
   cancels its node legs. The admission slot is released when step 4 ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.frontend import Frontend
from gateway.generation import FinishReason, GenerationRequest, StageTimings, TokenLogprob, Usage
from gateway.openai_protocol import (
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
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprobInfo,
    TopLogprob,
    UsageInfo,
)
from gateway.sampling import SamplingOptions
from gateway.sse import DONE, MEDIA_TYPE, sse_event
from gateway.text_stream import TextDelta, TextFinished, stream_text
from gateway.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI's stand-in for a logprob of -inf: JSON has no infinities.
_MIN_LOGPROB = -9999.0
_INT64 = 2**63
_VALIDATION_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})

_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request: `error.param` names the offending field"),
        (401, "Missing or invalid API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "Server at capacity; retry later"),
        (503, "No healthy node, or the generation failed"),
        (504, "The request's deadline passed"),
    )
}
_STREAM_RESPONSE: dict[int | str, dict[str, object]] = {
    200: {
        "description": "JSON, or with `stream: true` server-sent events: `data: {chunk}` "
        "lines, then `data: [DONE]`",
        "content": {MEDIA_TYPE: {"schema": {"type": "string"}}},
    }
}


def build_openai_app(frontend: Frontend) -> FastAPI:
    """The HTTP API of one gateway: OpenAI routes under ``/v1``, ``/health`` and ``/metrics``."""
    app = FastAPI(
        title="pdserve",
        summary="OpenAI-compatible API of a disaggregated prefill/decode LLM server",
        version="0.1.0",
    )
    metrics = frontend.metrics
    # Read at scrape time, so always exact: Admission counts for every front end sharing it.
    metrics.num_requests_running.set_function(lambda: frontend.admission.num_running)
    metrics.num_requests_waiting.set_function(lambda: frontend.admission.num_queued)
    app.add_middleware(_Gate, frontend=frontend)
    _install_error_handlers(app, frontend)
    _drop_fastapi_422(app)
    created = int(time.time())

    # auto_error=False: _Gate enforces the key (before the body is read); this declares the
    # scheme in the OpenAPI document.
    bearer = HTTPBearer(auto_error=False)
    v1 = APIRouter(prefix="/v1", dependencies=[Security(bearer)])

    @v1.post(
        "/completions",
        response_model=CompletionResponse,
        responses={**_STREAM_RESPONSE, **_ERROR_RESPONSES},
    )
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        job = _completion_job(body, request, frontend)
        return _GenerationResponse(frontend, job)

    @v1.post(
        "/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_STREAM_RESPONSE, **_ERROR_RESPONSES},
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        job = _chat_job(body, request, frontend)
        return _GenerationResponse(frontend, job)

    def model_card() -> ModelCard:
        return ModelCard(
            id=frontend.served_model_name,
            created=created,
            max_model_len=frontend.limits.max_model_len,
        )

    @v1.get("/models", response_model=ModelList, responses={401: _ERROR_RESPONSES[401]})
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @v1.get(
        "/models/{model}",
        response_model=ModelCard,
        responses={401: _ERROR_RESPONSES[401], 404: _ERROR_RESPONSES[404]},
    )
    async def retrieve_model(model: str) -> ModelCard:
        _check_model(model, frontend)
        return model_card()

    app.include_router(v1)

    @app.get(
        "/health",
        responses={503: {"model": ErrorResponse, "description": "No healthy node"}},
    )
    async def health() -> dict[str, str]:
        if not frontend.is_ready():
            raise GatewayError(ErrorKind.UNAVAILABLE, "no healthy prefill/decode pair or node")
        return {"status": "ok"}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}},
    )
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# --- validation before admission: what needs no tokenizer ------------------------------------


@dataclass(frozen=True)
class _Job:
    """One validated generation request, not yet tokenized."""

    body: CompletionRequest | ChatCompletionRequest
    request_id: str
    arrival: float
    """``time.monotonic()`` when the request reached the gateway."""
    created: int
    stop: tuple[str, ...]
    num_logprobs: int | None
    """Alternatives per token to ask the nodes for; None: no logprobs."""

    @property
    def is_chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)

    @property
    def include_usage(self) -> bool:
        options = self.body.stream_options
        return options is not None and options.include_usage


def _completion_job(body: CompletionRequest, request: Request, frontend: Frontend) -> _Job:
    stop = _check_common(body, frontend)
    if body.echo:
        raise invalid("echo is not supported", param="echo")
    if body.suffix:
        raise invalid("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise invalid(f"best_of must equal n ({body.n}); ranking is not supported", "best_of")
    prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    if not prompts or any(len(prompt) == 0 for prompt in prompts if not isinstance(prompt, int)):
        raise invalid("prompt must not be empty", param="prompt")
    is_batch = isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list))
    if is_batch and len(prompts) > frontend.limits.max_prompts:
        raise invalid(
            f"at most {frontend.limits.max_prompts} prompts per request, got {len(prompts)}",
            param="prompt",
        )
    num_logprobs = body.logprobs
    _check_num_logprobs(num_logprobs, "logprobs", frontend)
    return _new_job(body, request, "cmpl", stop, num_logprobs)


def _chat_job(body: ChatCompletionRequest, request: Request, frontend: Frontend) -> _Job:
    stop = _check_common(body, frontend)
    if body.tools:
        raise invalid("tools are not supported", param="tools")
    if body.tool_choice not in (None, "none"):
        raise invalid("tool_choice is not supported beyond 'none'", param="tool_choice")
    if body.functions:
        raise invalid("functions are not supported", param="functions")
    if body.function_call not in (None, "none"):
        raise invalid("function_call is not supported beyond 'none'", param="function_call")
    if body.response_format is not None and body.response_format.type != "text":
        raise invalid(
            f"response_format {body.response_format.type!r} is not supported; only 'text'",
            param="response_format",
        )
    if body.audio is not None:
        raise invalid("audio output is not supported", param="audio")
    if body.modalities is not None and body.modalities != ["text"]:
        raise invalid("only the 'text' modality is supported", param="modalities")
    for index, message in enumerate(body.messages):
        if isinstance(message.content, list):
            for part_index, part in enumerate(message.content):
                where = f"messages[{index}].content[{part_index}]"
                if part.type != "text":
                    raise invalid(
                        f"{where}: content of type {part.type!r} is not supported; "
                        "this server takes text only",
                        param=f"{where}.type",
                    )
                if part.text is None:
                    raise invalid(f"{where}: a text part needs 'text'", param=f"{where}.text")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    _check_num_logprobs(num_logprobs, "top_logprobs", frontend)
    return _new_job(body, request, "chatcmpl", stop, num_logprobs)


def _check_common(
    body: CompletionRequest | ChatCompletionRequest, frontend: Frontend
) -> tuple[str, ...]:
    """Checks shared by both routes; returns the stop strings as a tuple."""
    _check_model(body.model, frontend)
    limits = frontend.limits
    if body.n > limits.max_n:
        raise invalid(f"n must be <= {limits.max_n}, got {body.n}", param="n")
    if body.logit_bias:
        raise invalid("logit_bias is not supported", param="logit_bias")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options needs stream: true", param="stream_options")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > limits.max_stop_strings:
        raise invalid(
            f"at most {limits.max_stop_strings} stop strings, got {len(stop)}", param="stop"
        )
    for text in stop:
        if not 1 <= len(text) <= limits.max_stop_string_chars:
            raise invalid(
                f"each stop string must have 1 to {limits.max_stop_string_chars} characters, "
                f"got {len(text)}",
                param="stop",
            )
    vocab_size = frontend.tokenizer.vocab_size
    for token_id in body.stop_token_ids or ():
        if token_id >= vocab_size:
            raise invalid(
                f"stop token id {token_id} is outside the vocabulary [0, {vocab_size})",
                param="stop_token_ids",
            )
    return stop


def _check_model(model: str, frontend: Frontend) -> None:
    if model != frontend.served_model_name:
        raise GatewayError(
            ErrorKind.NOT_FOUND,
            f"model {model!r} does not exist; this server serves {frontend.served_model_name!r}",
            param="model",
        )


def _check_num_logprobs(num_logprobs: int | None, param: str, frontend: Frontend) -> None:
    max_logprobs = frontend.limits.max_logprobs
    if num_logprobs is not None and num_logprobs > max_logprobs:
        raise invalid(f"{param} must be <= {max_logprobs}, got {num_logprobs}", param=param)


def _new_job(
    body: CompletionRequest | ChatCompletionRequest,
    request: Request,
    id_prefix: str,
    stop: tuple[str, ...],
    num_logprobs: int | None,
) -> _Job:
    request_id = request.headers.get("x-request-id")
    if request_id is None:
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    elif not _REQUEST_ID.fullmatch(request_id):
        # The id reaches log lines and node requests: keep it short and printable.
        raise invalid("X-Request-Id must be 1 to 128 characters of [A-Za-z0-9._:-]")
    return _Job(
        body=body,
        request_id=request_id,
        arrival=request.state.arrival,
        created=int(time.time()),
        stop=stop,
        num_logprobs=num_logprobs,
    )


# --- validation after admission: tokens ------------------------------------------------------


def _prompt_token_ids(job: _Job, tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """The token ids of each prompt (chat: one), checked against the vocabulary."""
    body = job.body
    if isinstance(body, ChatCompletionRequest):
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        prompts = [tokenizer.encode_chat(messages, add_generation_prompt=True)]
        param = "messages"
    else:
        prompt = body.prompt
        param = "prompt"
        if isinstance(prompt, str):
            prompts = [tokenizer.encode(prompt)]
        elif isinstance(prompt[0], str):
            prompts = [tokenizer.encode(text) for text in prompt]  # type: ignore[arg-type]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]  # type: ignore[arg-type]
        else:
            prompts = [list(ids) for ids in prompt]  # type: ignore[union-attr]
    vocab_size = tokenizer.vocab_size
    for index, ids in enumerate(prompts):
        where = param if len(prompts) == 1 else f"{param}[{index}]"
        if not ids:
            raise invalid(f"{where} is empty", param=param)
        out_of_vocab = next((token_id for token_id in ids if token_id >= vocab_size), None)
        if out_of_vocab is not None:
            raise invalid(
                f"{where} has token id {out_of_vocab}, outside the vocabulary [0, {vocab_size})",
                param=param,
            )
    return [tuple(ids) for ids in prompts]


def _sampling_options(
    job: _Job, prompt_len: int, choice: int, frontend: Frontend
) -> SamplingOptions:
    body = job.body
    limits = frontend.limits
    param = "messages" if job.is_chat else "prompt"
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise invalid(
            f"{param} has {prompt_len} tokens; max_model_len is {limits.max_model_len}, "
            "which leaves no room for output",
            param=param,
        )
    requested, max_param = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        requested, max_param = body.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        default = limits.max_tokens if job.is_chat else _COMPLETIONS_DEFAULT_MAX_TOKENS
        max_tokens = min(default, room, limits.max_tokens)
    elif requested > limits.max_tokens:
        raise invalid(
            f"{max_param} must be <= {limits.max_tokens}, got {requested}", param=max_param
        )
    elif requested > room:
        raise invalid(
            f"{param} has {prompt_len} tokens and {max_param} is {requested}: more than "
            f"max_model_len={limits.max_model_len} together",
            param=max_param,
        )
    else:
        max_tokens = requested
    seed = None
    if body.seed is not None:
        # seed + choice: the n choices differ, and each stays reproducible; wrapped into int64.
        seed = (body.seed + choice + _INT64) % (2 * _INT64) - _INT64
    return SamplingOptions(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens or 0,
        temperature=body.temperature,
        top_k=-1 if body.top_k == 0 else body.top_k,
        top_p=body.top_p,
        min_p=body.min_p or 0.0,
        seed=seed,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=job.num_logprobs,
    )


# --- the concurrent choices of one request ---------------------------------------------------

_ChoiceEvent = TextDelta | TextFinished


class _Choices:
    """The generations of one HTTP request (prompts × n), each pumped by its own task into one
    queue: events of one choice stay in order; choices interleave as their tokens arrive."""

    def __init__(
        self,
        frontend: Frontend,
        job: _Job,
        requests: Sequence[GenerationRequest],
    ) -> None:
        self._frontend = frontend
        self._job = job
        self._requests = requests
        self._queue: asyncio.Queue[tuple[int, _ChoiceEvent | Exception]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> _Choices:
        self._tasks = [
            asyncio.create_task(self._pump(index, request), name=request.request_id)
            for index, request in enumerate(self._requests)
        ]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # Cancelling a pump closes its iterators; the generator then cancels its node legs.
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def first_events(self) -> list[tuple[int, _ChoiceEvent]]:
        """Events up to every choice's first one; the first error among them is raised."""
        waiting = set(range(len(self._requests)))
        events: list[tuple[int, _ChoiceEvent]] = []
        while waiting:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            events.append((index, item))
            waiting.discard(index)
        return events

    async def next(self) -> tuple[int, _ChoiceEvent | Exception]:
        return await self._queue.get()

    async def _pump(self, index: int, request: GenerationRequest) -> None:
        job = self._job
        try:
            events = self._frontend.generator.generate(request)
            try:
                texts = stream_text(
                    events,
                    self._frontend.tokenizer,
                    request.prompt_token_ids,
                    stop=job.stop,
                    include_stop_str_in_output=job.body.include_stop_str_in_output,
                    skip_special_tokens=job.body.skip_special_tokens,
                )
                try:
                    is_finished = False
                    async for event in texts:
                        self._queue.put_nowait((index, event))
                        is_finished = isinstance(event, TextFinished)
                    if not is_finished:  # the consumer waits for a TextFinished: never a hang
                        raise RuntimeError("the text stream ended without a final event")
                finally:
                    await _aclose(texts)
            finally:
                await _aclose(events)
        except GatewayError as error:
            self._queue.put_nowait((index, error))
        except Exception as error:  # a bug: the request fails, the server goes on
            logger.exception("request %s failed", request.request_id)
            self._queue.put_nowait((index, error))


async def _aclose(iterator: object) -> None:
    # Generator.generate promises an AsyncIterator; the real ones are async generators, whose
    # aclose() is what cancels the node legs when the generation did not run to its end.
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


# --- output: per-choice state and the two wire formats ---------------------------------------


@dataclass
class _ChoiceState:
    index: int
    prompt_token_ids: tuple[int, ...]
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    num_chars: int = 0
    num_tokens: int = 0
    is_started: bool = False
    """A chunk of this choice went out (chat: the role was sent)."""
    finished: TextFinished | None = None


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


class _Format:
    """How one API shapes chunks and responses; one subclass per route."""

    def __init__(self, job: _Job, tokenizer: Tokenizer, model: str) -> None:
        self.job = job
        self.tokenizer = tokenizer
        self.model = model

    def delta_chunk(self, state: _ChoiceState, delta: TextDelta) -> BaseModel | None:
        raise NotImplementedError

    def finish_chunk(self, state: _ChoiceState) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def response(self, states: Sequence[_ChoiceState], usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def has_logprobs(self, delta: TextDelta) -> bool:
        return self.job.num_logprobs is not None and bool(delta.token_ids) and bool(delta.logprobs)


class _CompletionFormat(_Format):
    def legacy_logprobs(
        self, logprobs: Sequence[TokenLogprob], offsets: Sequence[int]
    ) -> CompletionLogprobs:
        text = self.tokenizer.token_text
        return CompletionLogprobs(
            tokens=[text(lp.token_id) for lp in logprobs],
            token_logprobs=[_finite(lp.logprob) for lp in logprobs],
            top_logprobs=[{text(t): _finite(lp_) for t, lp_ in lp.top} for lp in logprobs],
            text_offset=list(offsets),
        )

    def delta_chunk(self, state: _ChoiceState, delta: TextDelta) -> BaseModel | None:
        if not delta.text and not self.has_logprobs(delta):
            return None
        logprobs = None
        if self.has_logprobs(delta):
            logprobs = self.legacy_logprobs(
                delta.logprobs or (), state.text_offsets[-len(delta.logprobs or ()) :]
            )
        return self._chunk(CompletionChoice(index=state.index, text=delta.text, logprobs=logprobs))

    def finish_chunk(self, state: _ChoiceState) -> BaseModel:
        assert state.finished is not None
        return self._chunk(
            CompletionChoice(
                index=state.index,
                text="",
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

    def response(self, states: Sequence[_ChoiceState], usage: UsageInfo) -> BaseModel:
        choices = []
        for state in states:
            assert state.finished is not None
            logprobs = None
            if self.job.num_logprobs is not None:
                logprobs = self.legacy_logprobs(state.logprobs, state.text_offsets)
            choices.append(
                CompletionChoice(
                    index=state.index,
                    text="".join(state.texts),
                    logprobs=logprobs,
                    finish_reason=state.finished.finish_reason.value,
                    stop_reason=state.finished.stop_reason,
                )
            )
        return CompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.model, choices=choices,
            usage=usage,
        )  # fmt: skip


class _ChatFormat(_Format):
    def chat_logprobs(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
        def top(token_id: int, logprob: float) -> TopLogprob:
            return TopLogprob(
                token=self.tokenizer.token_text(token_id),
                logprob=_finite(logprob),
                bytes=list(self.tokenizer.token_bytes(token_id)),
            )

        content = []
        for lp in logprobs:
            sampled = top(lp.token_id, lp.logprob)
            content.append(
                TokenLogprobInfo(
                    **sampled.model_dump(), top_logprobs=[top(t, lp_) for t, lp_ in lp.top]
                )
            )
        return ChatLogprobs(content=content)

    def delta_chunk(self, state: _ChoiceState, delta: TextDelta) -> BaseModel | None:
        # The first chunk of a choice carries the role with its first content, so a client's
        # TTFT is measured at a real token.
        if state.is_started and not delta.text and not self.has_logprobs(delta):
            return None
        logprobs = self.chat_logprobs(delta.logprobs or ()) if self.has_logprobs(delta) else None
        choice = ChatChunkChoice(
            index=state.index,
            delta=ChatDelta(role=None if state.is_started else "assistant", content=delta.text),
            logprobs=logprobs,
        )
        return self._chunk([choice])

    def finish_chunk(self, state: _ChoiceState) -> BaseModel:
        assert state.finished is not None
        delta = ChatDelta() if state.is_started else ChatDelta(role="assistant", content="")
        return self._chunk(
            [
                ChatChunkChoice(
                    index=state.index,
                    delta=delta,
                    finish_reason=state.finished.finish_reason.value,
                    stop_reason=state.finished.stop_reason,
                )
            ]
        )

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        chunk = self._chunk([])
        chunk.usage = usage
        return chunk

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.job.request_id, created=self.job.created, model=self.model, choices=choices
        )

    def response(self, states: Sequence[_ChoiceState], usage: UsageInfo) -> BaseModel:
        choices = []
        for state in states:
            assert state.finished is not None
            logprobs = None
            if self.job.num_logprobs is not None:
                logprobs = self.chat_logprobs(state.logprobs)
            choices.append(
                ChatChoice(
                    index=state.index,
                    message=ChatResponseMessage(content="".join(state.texts)),
                    logprobs=logprobs,
                    finish_reason=state.finished.finish_reason.value,
                    stop_reason=state.finished.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.job.request_id, created=self.job.created, model=self.model, choices=choices,
            usage=usage,
        )  # fmt: skip


# --- the response: one request's whole life after validation --------------------------------


class _ClientDisconnected(Exception):
    pass


class _GenerationResponse(Response):
    """An ASGI response that runs the request: its status is known only once every choice has
    its first event, so the admission, the generation and the sending all happen here."""

    def __init__(self, frontend: Frontend, job: _Job) -> None:
        super().__init__()
        self._frontend = frontend
        self._job = job
        self._is_started = False
        self._is_client_gone = False
        self._n = job.body.n
        self._format: _Format = (_ChatFormat if job.is_chat else _CompletionFormat)(
            job, frontend.tokenizer, frontend.served_model_name
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        serve = asyncio.create_task(self._serve(send))
        watch = asyncio.create_task(_wait_for_disconnect(receive))
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
            queued_at = time.monotonic()
            async with frontend.admission.admit():
                metrics.request_queue_time.observe(time.monotonic() - queued_at)
                # In a thread: a long prompt takes seconds to tokenize (4 MiB: ~6 s), which on
                # the loop would stall every other stream. NOTE: Tokenizer.encode holds the GIL
                # today; the loop gains only once it encodes through a GIL-releasing call.
                prompts = await asyncio.to_thread(_prompt_token_ids, self._job, frontend.tokenizer)
                states, requests = self._plan(prompts)
                async with _Choices(frontend, self._job, requests) as choices:
                    first_events = await choices.first_events()
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
        except GatewayError as error:
            metrics.request_errors.labels(reason=error.kind.name.lower()).inc()
            if not self._is_started:
                await self._send_json(send, error.kind.http_status, error.openai_body())
        except Exception:
            logger.exception("request %s failed", self._job.request_id)
            metrics.request_errors.labels(reason="internal").inc()
            if not self._is_started:
                await self._send_json(send, 500, _internal_error_body())

    def _plan(
        self, prompts: list[tuple[int, ...]]
    ) -> tuple[list[_ChoiceState], list[GenerationRequest]]:
        job = self._job
        num_choices = len(prompts) * self._n
        states, requests = [], []
        for prompt_index, prompt in enumerate(prompts):
            for choice in range(self._n):
                index = prompt_index * self._n + choice
                request_id = job.request_id if num_choices == 1 else f"{job.request_id}-{index}"
                sampling = _sampling_options(job, len(prompt), choice, self._frontend)
                states.append(_ChoiceState(index=index, prompt_token_ids=prompt))
                requests.append(
                    GenerationRequest(
                        request_id=request_id,
                        prompt_token_ids=prompt,
                        sampling=sampling,
                        deadline=self._deadline(),
                        arrival=job.arrival,
                    )
                )
        return states, requests

    def _deadline(self) -> float | None:
        timeout_s = self._frontend.request_timeout_s
        return None if timeout_s is None else self._job.arrival + timeout_s

    async def _stream(
        self,
        send: Send,
        states: list[_ChoiceState],
        choices: _Choices,
        first_events: list[tuple[int, _ChoiceEvent]],
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

        async def emit(index: int, item: _ChoiceEvent | Exception) -> None:
            state = states[index]
            event = self._update(state, item)
            if isinstance(event, TextDelta):
                chunk = self._format.delta_chunk(state, event)
                if chunk is not None:
                    state.is_started = True
                    await self._send_body(send, sse_event(chunk))
                return
            await self._send_body(send, sse_event(self._format.finish_chunk(state)))
            if event.finish_reason == FinishReason.ERROR:
                errors.append(f"choice {index} failed: {event.error or 'unknown error'}")

        try:
            for index, event in first_events:
                await emit(index, event)
            while any(state.finished is None for state in states):
                await emit(*await choices.next())
            if self._job.include_usage:
                await self._send_body(
                    send, sse_event(self._format.usage_chunk(self._usage(states)))
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
                        await self._send_body(send, sse_event(self._format.finish_chunk(state)))
                await self._send_body(send, DONE)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            raise
        except Exception:  # a bug: end the stream visibly rather than leave the client hanging
            logger.exception("request %s: stream failed", self._job.request_id)
            self._frontend.metrics.request_errors.labels(reason="internal").inc()
            errors.append("internal error")
        if errors:
            self._frontend.metrics.request_errors.labels(reason="generation_failed").inc()
            error = GatewayError(ErrorKind.UNAVAILABLE, "; ".join(errors))
            await self._send_body(send, sse_event(error.openai_body()))
        await self._send_body(send, DONE)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _respond(
        self,
        send: Send,
        states: list[_ChoiceState],
        choices: _Choices,
        first_events: list[tuple[int, _ChoiceEvent]],
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
            self._frontend.metrics.request_errors.labels(reason="generation_failed").inc()
            await self._send_json(
                send, 503, GatewayError(ErrorKind.UNAVAILABLE, message).openai_body()
            )
            return
        response = self._format.response(states, self._usage(states))
        await self._send_json(send, 200, response)

    def _update(self, state: _ChoiceState, item: _ChoiceEvent | Exception) -> _ChoiceEvent:
        """Record one event of a choice; an exception after the choice's first event ends it
        with reason ``error``.

        NOTE: latency and finish metrics are the generator's to observe (it sees every front
        end's tokens); observing them here too would count each request twice.
        """
        if isinstance(item, Exception):
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
        state.texts.append(item.text)
        state.logprobs.extend(item.logprobs or ())
        state.num_chars = end
        state.num_tokens += len(item.token_ids)
        return item

    def _usage(self, states: Sequence[_ChoiceState]) -> UsageInfo:
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
        self, send: Send, status: int, body: BaseModel | dict[str, object]
    ) -> None:
        self._is_started = True
        await _send_json(send, status, body, [(b"x-request-id", self._job.request_id.encode())])


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _internal_error_body() -> dict[str, object]:
    return {"error": {"message": "internal error", "type": "internal_error", "param": None,
                      "code": 500}}  # fmt: skip


async def _send_json(
    send: Send,
    status: int,
    body: BaseModel | dict[str, object],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    content = body.model_dump_json().encode() if isinstance(body, BaseModel) else None
    if content is None:
        content = JSONResponse(body).body
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(content)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": content, "more_body": False})


# --- the edge: auth and body size, before FastAPI reads anything ----------------------------


class _Gate:
    """ASGI middleware: arrival time, the API key on ``/v1/*``, and the body-size bound.

    The body is read here, whole, so that its size is known before FastAPI parses it (a client
    may lie in Content-Length or send chunked); the app then receives it as one message.
    """

    def __init__(self, app: ASGIApp, frontend: Frontend) -> None:
        self._app = app
        self._frontend = frontend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrival"] = time.monotonic()
        headers = {name.lower(): value for name, value in scope["headers"]}
        try:
            path = scope["path"]
            if path == "/v1" or path.startswith("/v1/"):
                authorization = headers.get(b"authorization")
                self._frontend.api_keys.check(
                    None if authorization is None else authorization.decode("latin-1")
                )
            body = await self._read_body(receive, headers.get(b"content-length"))
        except GatewayError as error:
            self._frontend.metrics.request_errors.labels(reason=error.kind.name.lower()).inc()
            extra = []
            if error.kind is ErrorKind.UNAUTHENTICATED:
                extra = [(b"www-authenticate", b"Bearer")]
            await _send_json(send, error.kind.http_status, error.openai_body(), extra)
            return
        except _ClientDisconnected:
            return
        is_replayed = False

        async def replay() -> Message:
            nonlocal is_replayed
            if not is_replayed:
                is_replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._app(scope, replay, send)

    async def _read_body(self, receive: Receive, content_length: bytes | None) -> bytes:
        max_bytes = self._frontend.limits.max_body_bytes
        if content_length is not None:
            try:
                declared = int(content_length)
            except ValueError:
                raise invalid("Content-Length is not a number") from None
            if declared > max_bytes:
                raise _too_large(max_bytes)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientDisconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(max_bytes: int) -> GatewayError:
    return GatewayError(
        ErrorKind.PAYLOAD_TOO_LARGE, f"request body is larger than {max_bytes} bytes"
    )


# --- errors in the OpenAI shape --------------------------------------------------------------


def _install_error_handlers(app: FastAPI, frontend: Frontend) -> None:
    errors = frontend.metrics.request_errors

    @app.exception_handler(GatewayError)
    async def on_gateway_error(request: Request, error: GatewayError) -> JSONResponse:
        errors.labels(reason=error.kind.name.lower()).inc()
        return JSONResponse(error.openai_body(), status_code=error.kind.http_status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors.labels(reason="invalid_argument").inc()
        return JSONResponse(_validation_error(exc).openai_body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: ErrorKind.NOT_FOUND, 413: ErrorKind.PAYLOAD_TOO_LARGE}.get(
            exc.status_code, ErrorKind.INVALID_ARGUMENT
        )
        errors.labels(reason=kind.name.lower()).inc()
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        body = GatewayError(kind, message).openai_body()
        body["error"]["code"] = exc.status_code  # type: ignore[index]
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _validation_error(exc: RequestValidationError) -> GatewayError:
    """The first pydantic error as a GatewayError whose param is the field path."""
    details = list(exc.errors())
    if not details:
        return invalid("invalid request")
    first = details[0]
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return invalid(f"the request body is not valid JSON: {reason}".rstrip(": "))
    if not loc:
        if first.get("type") == "missing":
            return invalid("a JSON request body is required")
        if isinstance(first.get("input"), dict):  # e.g. a key that is not valid Unicode
            return invalid(f"invalid request body: {first.get('msg', '')}")
        return invalid("the request body must be a JSON object (Content-Type: application/json)")
    if first.get("type") == "extra_forbidden":
        # The last element is the unknown key itself, whatever characters it holds.
        key = str(loc[-1]).encode("utf-8", "backslashreplace").decode()
        path = _field_path(loc[:-1])
        path = f"{path}.{key}" if path else key
        return invalid(f"unsupported parameter: {path}", param=path)
    path = _field_path(loc)
    message = f"{path}: {first.get('msg', 'invalid value')}"
    if any(isinstance(part, str) and not _is_field_name(part) for part in loc):
        # pydantic names the member of a union it tried: it is no part of the field's path.
        message += " (the value matches none of the types this field accepts)"
    return invalid(message, param=path)


def _field_path(loc: Sequence[int | str]) -> str:
    """``("messages", 0, "content")`` → ``messages[0].content``, without union member tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_field_name(part):
            path += f".{part}" if path else part
    return path


def _is_field_name(part: str) -> bool:
    return part.isidentifier() and part.lower() not in _VALIDATION_TYPE_NAMES


def _drop_fastapi_422(app: FastAPI) -> None:
    """Validation errors are 400s here; drop the 422 FastAPI documents on every operation."""
    build = app.openapi

    def openapi() -> dict[str, object]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
