"""The public gRPC API (``pdserve.v1.GatewayService``): protobuf in, the shared front-end
pipeline inside (``gateway.pipeline``: checks, admission, tokenize, generate, text), protobuf
out. Authentication and the per-key limits come first, as on the HTTP bridge.

Errors before the first delta abort the call with the status of their ``ErrorKind``
(INVALID_ARGUMENT naming the field, UNAUTHENTICATED, RESOURCE_EXHAUSTED, UNAVAILABLE, ...).
A cancelled call (client gone, deadline) closes the generator, which cancels both node legs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

import grpc

from gateway.auth import ApiKey
from gateway.chat_output import ChatOutput
from gateway.embeddings import embed_all, embedding_prompts
from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.frontend import Frontend
from gateway.generation import CLIENT_REQUEST_ID, GenerationRequest
from gateway.grpc_chat import ChatInput, chat_input, in_chat
from gateway.guided import check
from gateway.lora_admin import load_adapter, unload_adapter
from gateway.metrics import stream_failure
from gateway.pipeline import TextOptions, admitted, generate_text, tokenize
from gateway.text.text_stream import TextDelta, TextFinished
from gateway.tool_calls import ToolCallStream, ToolMode
from gateway.tool_parsers import make_parser
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.bad_words import bad_words_token_ids
from services.convert import (
    finish_reason_to_proto,
    sampling_params_from_proto,
    stage_timings_to_proto,
    token_logprob_to_proto,
    usage_to_proto,
)
from services.types import PoolingParams, SamplingParamError, SamplingParams

_DEFAULT_MAX_TOKENS = 16  # a request's max_tokens when neither it nor the model sets one

logger = logging.getLogger(__name__)

# Strings: grpc.aio.ServicerContext is generic in its stubs only, not at run time.
_GenerateContext: TypeAlias = (
    "grpc.aio.ServicerContext["
    "gateway_pb2.GatewayGenerateRequest, gateway_pb2.GatewayGenerateResponse]"
)
_ListModelsContext: TypeAlias = (
    "grpc.aio.ServicerContext[gateway_pb2.ListModelsRequest, gateway_pb2.ListModelsResponse]"
)
_EmbedContext: TypeAlias = (
    "grpc.aio.ServicerContext[gateway_pb2.GatewayEmbedRequest, gateway_pb2.GatewayEmbedResponse]"
)
_LoraContext: TypeAlias = "grpc.aio.ServicerContext[Any, gateway_pb2.GatewayLoraAdapterResponse]"


@dataclass(frozen=True)
class _Checked:
    """What ``_check`` found valid before admission."""

    sampling: SamplingParams
    chat: ChatInput | None
    prompt_tokens_kept: int | None
    """``truncate_prompt_tokens``, resolved (``RequestLimits.prompt_tokens_kept``)."""


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def Generate(
        self, request: gateway_pb2.GatewayGenerateRequest, context: _GenerateContext
    ) -> AsyncIterator[gateway_pb2.GatewayGenerateResponse]:
        arrival = time.monotonic()
        frontend = self.frontend
        lease = None
        try:
            key = self._authenticate(context)
            lease = frontend.key_limiter.acquire(key)  # released when the stream ends
            # In a worker thread, as the HTTP API builds its jobs: a grammar's check can take
            # seconds (llguidance's lexer on x{1000}{1000}), which would stall every stream.
            checked = await asyncio.to_thread(self._check, request)
            options = TextOptions(
                stop=tuple(request.stop),
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=(
                    request.skip_special_tokens if request.HasField("skip_special_tokens") else True
                ),
            )
            output = self._chat_output(checked)
            async with admitted(frontend):
                generation = await tokenize(self._generation_request, request, checked, arrival)
                async with generate_text(frontend, generation, options) as texts:
                    async for item in texts:
                        if isinstance(item, TextDelta):
                            yield _delta_response(item, output)
                        else:
                            failure = stream_failure(item.finish_reason, item.invalid_request)
                            if failure is not None:
                                frontend.metrics.request_errors.labels(reason=failure).inc()
                            for response in _final_responses(item, output, generation.request_id):
                                yield response
        except GatewayError as exc:
            await self._abort(context, exc)
        finally:
            if lease is not None:
                lease.release()

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: _ListModelsContext
    ) -> gateway_pb2.ListModelsResponse:
        try:
            self._authenticate(context)
        except GatewayError as exc:
            self.frontend.metrics.request_errors.labels(reason=exc.reason).inc()  # as /v1/models
            await context.abort(exc.kind.grpc_code, exc.message)
        lora_names = self.frontend.lora_names
        return gateway_pb2.ListModelsResponse(
            models=[
                gateway_pb2.ModelCard(
                    id=name,
                    max_model_len=self.frontend.limits.max_model_len,
                    parent=self.frontend.served_model_name if name in lora_names else "",
                )
                for name in self.frontend.model_names
            ]
        )

    async def Embed(
        self, request: gateway_pb2.GatewayEmbedRequest, context: _EmbedContext
    ) -> gateway_pb2.GatewayEmbedResponse:
        """As ``/v1/embeddings`` (``gateway/embeddings.py``): the key and its limits, the
        fields, an admission slot, then every input at once."""
        arrival = time.monotonic()
        frontend = self.frontend
        lease = None
        try:
            key = self._authenticate(context)
            lease = frontend.key_limiter.acquire(key)
            self._check_model(request.model, request.request_id)
            if request.texts and request.token_ids:
                raise invalid("give texts or token_ids, not both", param="texts")
            inputs: list[str] | list[list[int]] = (
                list(request.texts) if request.texts else [list(t.ids) for t in request.token_ids]
            )
            keep = frontend.limits.prompt_tokens_kept(
                request.truncate_prompt_tokens
                if request.HasField("truncate_prompt_tokens")
                else None,
                "truncate_prompt_tokens",
            )
            try:
                pooling = PoolingParams(
                    normalize=request.normalize if request.HasField("normalize") else None,
                    dimensions=request.dimensions if request.HasField("dimensions") else None,
                )
            except SamplingParamError as exc:
                raise invalid(str(exc), param=exc.param) from None
            async with admitted(frontend):
                prompts = await embedding_prompts(
                    inputs,
                    frontend,
                    add_special_tokens=(
                        request.add_special_tokens
                        if request.HasField("add_special_tokens")
                        else True
                    ),
                    keep=keep,
                    param="texts" if request.texts else "token_ids",
                )
                embeddings = await embed_all(
                    frontend,
                    prompts,
                    request_id=request.request_id or uuid.uuid4().hex,
                    pooling=pooling,
                    priority=request.priority,
                    lora_name=frontend.lora_name(request.model or None),
                    deadline=None
                    if frontend.request_timeout_s is None
                    else arrival + frontend.request_timeout_s,
                )
        except GatewayError as exc:
            await self._abort(context, exc)
        finally:
            if lease is not None:
                lease.release()
        return gateway_pb2.GatewayEmbedResponse(
            embeddings=[gateway_pb2.EmbeddingVector(values=e.vector) for e in embeddings],
            model=frontend.response_model(request.model or None),
            prompt_tokens=sum(map(len, prompts)),
        )

    async def LoadLoraAdapter(
        self, request: gateway_pb2.GatewayLoadLoraAdapterRequest, context: _LoraContext
    ) -> gateway_pb2.GatewayLoraAdapterResponse:
        try:
            self._authenticate(context)
            text = await load_adapter(self.frontend, request.lora_name, request.lora_path)
        except GatewayError as exc:
            await self._abort(context, exc)
        return gateway_pb2.GatewayLoraAdapterResponse(message=text)

    async def UnloadLoraAdapter(
        self, request: gateway_pb2.GatewayUnloadLoraAdapterRequest, context: _LoraContext
    ) -> gateway_pb2.GatewayLoraAdapterResponse:
        try:
            self._authenticate(context)
            text = await unload_adapter(self.frontend, request.lora_name)
        except GatewayError as exc:
            await self._abort(context, exc)
        return gateway_pb2.GatewayLoraAdapterResponse(message=text)

    async def _abort(
        self, context: grpc.aio.ServicerContext[Any, Any], exc: GatewayError
    ) -> NoReturn:
        """Ends the call with the refusal's status (and a ``retry-after`` trailer for a 429),
        counted once."""
        self.frontend.metrics.request_errors.labels(reason=exc.reason).inc()
        if exc.retry_after_s is not None:
            context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
        await context.abort(exc.kind.grpc_code, exc.message)

    def _check_model(self, model: str, request_id: str) -> None:
        frontend = self.frontend
        if model and model not in frontend.model_names:
            raise GatewayError(
                ErrorKind.NOT_FOUND,
                f"model {model!r} does not exist; this gateway serves "
                f"{', '.join(map(repr, frontend.model_names))}",
                param="model",
            )
        if request_id and not CLIENT_REQUEST_ID.fullmatch(request_id):
            raise invalid(
                "request_id must be 1 to 128 characters of [A-Za-z0-9._:-]", param="request_id"
            )

    def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> ApiKey | None:
        metadata = dict(context.invocation_metadata() or ())
        # A bytes value comes only for "-bin" keys, which "authorization" is not.
        authorization = metadata.get("authorization")
        return self.frontend.api_keys.check(
            authorization if isinstance(authorization, str) else None
        )

    def _chat_output(self, checked: _Checked) -> ChatOutput | None:
        """A chat's text → reasoning (with ``--reasoning-parser``, no grammar), content and tool
        calls (with tools to call); None when there is nothing to split."""
        if checked.chat is None:
            return None
        plan = checked.chat.tools
        tools = None
        if plan is not None and plan.mode is not ToolMode.NONE:
            parser = make_parser(
                self.frontend.tool_call_parser, self.frontend.tokenizer.backend.token_to_id
            )
            tools = ToolCallStream(plan, parser)
        # A grammar (sampling.guided, a forced call) covers the whole output: no reasoning.
        reasoning = self.frontend.reasoning_parser if checked.sampling.guided is None else None
        if tools is None and reasoning is None:
            return None
        return ChatOutput(reasoning, tools)

    def _check(self, request: gateway_pb2.GatewayGenerateRequest) -> _Checked:
        """What needs no tokenizer, before admission: model, input kind, sampling, stop, the
        chat fields."""
        frontend = self.frontend
        self._check_model(request.model, request.request_id)
        if request.WhichOneof("input") is None:
            raise invalid("input: set one of text, token_ids or chat", param="input")
        sampling = _sampling_from_proto(_with_model_defaults(request.sampling, frontend))
        sampling = _with_lora(sampling, frontend.lora_name(request.model or None), frontend)
        try:  # the node's check, before routing
            sampling.check_vocabulary(frontend.tokenizer.vocab_size)
        except SamplingParamError as exc:
            raise invalid(f"sampling.{exc}", param=f"sampling.{exc.param}") from None
        if len(sampling.bad_words_token_ids) > frontend.limits.max_bad_words:
            raise invalid(  # each is checked against every row's output at every step
                f"at most {frontend.limits.max_bad_words} sampling.bad_words_token_ids, got "
                f"{len(sampling.bad_words_token_ids)}",
                param="sampling.bad_words_token_ids",
            )
        conflict = sampling.min_tokens_conflict(frontend.tokenizer.eos_token_ids)
        if conflict is not None:
            raise invalid(f"sampling.{conflict}", param="sampling.allowed_token_ids")
        frontend.limits.check_logprobs(sampling.logprobs, "sampling.logprobs")
        frontend.limits.check_logprobs(sampling.prompt_logprobs, "sampling.prompt_logprobs")
        frontend.limits.check_stop(request.stop)
        frontend.limits.check_bad_words(request.bad_words)
        chat = chat_input(request.chat) if request.WhichOneof("input") == "chat" else None
        forced = None if chat is None or chat.tools is None else chat.tools.guided()
        if forced is not None:  # tool_choice required or named: a grammar forces the calls
            if sampling.guided is not None:
                raise invalid(
                    "chat.tool_choice forces the output; sampling.guided cannot be added",
                    param="sampling.guided",
                )
            check(forced, "chat.tools")
            sampling = dataclasses.replace(sampling, guided=forced)
        keep = frontend.limits.prompt_tokens_kept(
            request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None,
            "truncate_prompt_tokens",
        )
        return _Checked(sampling, chat, keep)

    def _generation_request(
        self, request: gateway_pb2.GatewayGenerateRequest, checked: _Checked, arrival: float
    ) -> GenerationRequest:
        """Tokenizes (after admission, in a thread) and checks what needs the token count."""
        frontend, limits = self.frontend, self.frontend.limits
        sampling = checked.sampling
        kind = request.WhichOneof("input")
        if kind == "text":
            prompt = frontend.tokenizer.encode(request.text)
        elif kind == "token_ids":
            prompt = list(request.token_ids.ids)
            vocab = frontend.tokenizer.vocab_size
            if any(token >= vocab for token in prompt):
                raise invalid(f"token_ids: ids must be < vocab size {vocab}", param="token_ids")
        else:
            assert checked.chat is not None
            chat = checked.chat
            tools = None if chat.tools is None else chat.tools.template_tools
            try:
                prompt = frontend.tokenizer.encode_chat(
                    chat.messages,
                    add_generation_prompt=chat.add_generation_prompt,
                    continue_final_message=chat.continue_final_message,
                    **{**chat.template_kwargs, "tools": tools},
                )
            except GatewayError as exc:  # the template names the OpenAI request's fields
                raise in_chat(exc) from None
        if checked.prompt_tokens_kept is not None:  # vLLM's left truncation
            prompt = prompt[-checked.prompt_tokens_kept :]
        if request.bad_words:
            words = bad_words_token_ids(frontend.tokenizer.encode_text, request.bad_words)
            sampling = dataclasses.replace(
                sampling, bad_words_token_ids=sampling.bad_words_token_ids + words
            )
        conflict = sampling.bad_words_conflict()
        if conflict is not None:  # the engine's refusal, here before routing
            raise invalid(f"sampling.{conflict}", param="sampling.bad_words_token_ids")
        if not prompt:
            raise invalid(f"{kind}: the prompt is empty", param=kind)
        if request.sampling.HasField("max_tokens"):
            limits.check_max_tokens(
                sampling.max_tokens, len(prompt), prompt_param=kind, max_param="sampling.max_tokens"
            )
        else:  # the model's default (or 16), within what the prompt leaves
            default = frontend.sampling_defaults.max_tokens or _DEFAULT_MAX_TOKENS
            room = limits.output_room(len(prompt), kind)
            try:
                sampling = dataclasses.replace(
                    sampling, max_tokens=min(default, room, limits.max_tokens)
                )
            except SamplingParamError as exc:  # min_tokens past what is left
                raise invalid(f"sampling.{exc}", param=f"sampling.{exc.param}") from None
        deadline = (
            arrival + frontend.request_timeout_s if frontend.request_timeout_s is not None else None
        )
        return GenerationRequest(
            request_id=request.request_id or f"gen-{uuid.uuid4().hex}",
            prompt_token_ids=tuple(prompt),
            sampling=sampling,
            deadline=deadline,
            arrival=arrival,
        )


def _with_model_defaults(
    message: common_pb2.SamplingParams, frontend: Frontend
) -> common_pb2.SamplingParams:
    """A copy whose unset sampling fields hold the model's defaults (``--generation-config``);
    ``max_tokens`` is settled after tokenization, where the prompt's length is known."""
    defaults = frontend.sampling_defaults
    filled = common_pb2.SamplingParams()
    filled.CopyFrom(message)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(defaults, name)
        if value is not None and not message.HasField(name):
            setattr(filled, name, value)
    return filled


def _with_lora(
    sampling: SamplingParams, model_lora: str | None, frontend: Frontend
) -> SamplingParams:
    """``sampling`` running the LoRA adapter the request's model names; a
    ``sampling.lora_name`` of the client's own must be an adapter the gateway serves and agree."""
    given = sampling.lora_name
    if given is not None and given not in frontend.lora_names:
        raise invalid(
            f"sampling.lora_name {given!r} is not a LoRA adapter of this gateway "
            f"({', '.join(map(repr, frontend.lora_names)) or 'none'})",
            param="sampling.lora_name",
        )
    if given is not None and model_lora is not None and given != model_lora:
        raise invalid(
            f"sampling.lora_name {given!r} differs from the model's adapter {model_lora!r}",
            param="sampling.lora_name",
        )
    if model_lora is None:
        return sampling
    return dataclasses.replace(sampling, lora_name=model_lora)


def _sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """The node's own checks, plus the grammar's, before admission: INVALID_ARGUMENT naming the
    field (``sampling.<name>``) instead of a node's refusal after routing."""
    try:
        sampling = sampling_params_from_proto(message)
    except SamplingParamError as exc:
        raise invalid(str(exc), param=f"sampling.{exc.param}") from None
    except ValueError as exc:  # an unknown guided kind
        raise invalid(str(exc), param="sampling.guided") from None
    if sampling.guided is not None:
        try:
            sampling.guided.check()
        except ValueError as exc:
            raise invalid(str(exc), param="sampling.guided") from None
    return sampling


def _delta_response(
    item: TextDelta, output: ChatOutput | None
) -> gateway_pb2.GatewayGenerateResponse:
    text, reasoning = item.text, ""
    if output is not None:  # reasoning and tool calls split off the text
        piece = output.feed(item.text)
        text, reasoning = piece.content or "", piece.reasoning
    return gateway_pb2.GatewayGenerateResponse(
        delta=gateway_pb2.GatewayTextDelta(
            text=text,
            reasoning=reasoning,
            token_ids=item.token_ids,
            logprobs=[token_logprob_to_proto(lp) for lp in item.logprobs or ()],
            prompt_logprobs=[token_logprob_to_proto(lp) for lp in item.prompt_logprobs or ()],
        )
    )


def _final_responses(
    item: TextFinished, output: ChatOutput | None, request_id: str
) -> list[gateway_pb2.GatewayGenerateResponse]:
    """What the parsers held back (a delta, if any), then ``finished`` with the tool calls."""
    responses = []
    calls: list[gateway_pb2.ChatToolCall] = []
    if output is not None:
        piece = output.finish()
        if piece.content or piece.reasoning:
            delta = gateway_pb2.GatewayTextDelta(
                text=piece.content or "", reasoning=piece.reasoning
            )
            responses.append(gateway_pb2.GatewayGenerateResponse(delta=delta))
        calls = [
            gateway_pb2.ChatToolCall(
                id=call.id, name=call.function.name, arguments=call.function.arguments
            )
            for call in output.tool_calls
        ]
    finished = gateway_pb2.GatewayFinished(
        tool_calls=calls,
        finish_reason=finish_reason_to_proto(item.finish_reason),
        usage=usage_to_proto(item.usage),
        timings=stage_timings_to_proto(item.timings),
        error=item.error or "",
        stop_reason=item.stop_reason if isinstance(item.stop_reason, str) else "",
        request_id=request_id,
        num_retries=item.num_retries,
        invalid_request=item.invalid_request,
    )
    responses.append(gateway_pb2.GatewayGenerateResponse(finished=finished))
    return responses
