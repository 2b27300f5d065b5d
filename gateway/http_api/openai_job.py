"""One OpenAI request turned into what the generator takes: an ``OpenAIJob``, then per choice a
``GenerationRequest``'s prompt token ids and ``SamplingParams``.

Validation comes in two steps, each raising a ``GatewayError`` that names the offending field:
``completion_job`` / ``chat_job`` check what needs no tokenizer, before admission (so a bad
request never waits for a slot); ``prompt_token_ids`` (off the event loop) and
``choice_requests`` check what needs the tokens, after admission.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from gateway.errors import ErrorKind, GatewayError, invalid, invalid_from
from gateway.frontend import Frontend
from gateway.generation import CLIENT_REQUEST_ID, GenerationRequest
from gateway.guided import check, guided_from_request
from gateway.http_api.chat_messages import check_chat_messages
from gateway.http_api.openai_protocol import ChatCompletionRequest, CompletionRequest
from gateway.limits import check_prompt_ids
from gateway.reasoning import ReasoningParser
from gateway.text.tokenizer import Tokenizer
from gateway.tool_calls import ToolMode, ToolPlan, tool_plan
from services.bad_words import bad_words_token_ids
from services.chat_template import OPENAI_TEMPLATE_FIELDS, ChatRequestError, check_template_kwargs
from services.guided_decoding import GuidedDecoding
from services.types import SamplingParamError, SamplingParams

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_INT64 = 2**63


# --- before admission: what needs no tokenizer ----------------------------------------------


@dataclass(frozen=True)
class OpenAIJob:
    """One validated generation request, not yet tokenized."""

    body: CompletionRequest | ChatCompletionRequest
    request_id: str
    arrival: float
    """``time.monotonic()`` when the request reached the gateway."""
    created: int
    stop: tuple[str, ...]
    num_logprobs: int | None
    """Alternatives per token to ask the nodes for; None: no logprobs."""
    num_prompt_logprobs: int | None = None
    """Alternatives per prompt token to ask the nodes for (``prompt_logprobs``, or ``logprobs``
    with ``echo``); None: no prompt logprobs."""
    guided: GuidedDecoding | None = None
    """The grammar every choice's output must follow (structured output or a forced tool call)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    tools: ToolPlan | None = None
    """Chat: the request's tools and how they may be called; None without tools."""
    tool_call_parser: str | None = None
    """Chat: ``--tool-call-parser``'s syntax for the calls in the text; None: the vocabulary's."""
    prompt_tokens_kept: int | None = None
    """``truncate_prompt_tokens``, resolved: each prompt's last tokens kept; None: all."""
    reasoning: ReasoningParser | None = None
    """Chat: how to split reasoning from content; None without ``--reasoning-parser``, or when
    a grammar constrains the whole output (it leaves no room for reasoning)."""
    param_names: tuple[tuple[str, str], ...] = ()
    """(the chat request's field, the client's name for it): a request translated into a chat
    (the Responses API) has its errors name what the client sent."""

    @property
    def is_chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)

    @property
    def include_usage(self) -> bool:
        options = self.body.stream_options
        return options is not None and options.include_usage

    @property
    def include_continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (vLLM's ``continuous_usage_stats``)."""
        options = self.body.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


def renamed(error: GatewayError, names: tuple[tuple[str, str], ...]) -> GatewayError:
    """``error`` with its param (and the name in its message) as the client called the field:
    ``names`` maps the chat request's names to the client's; itself when none applies."""
    for ours, theirs in names:
        param = error.param
        if param is not None and (param == ours or param.startswith((f"{ours}.", f"{ours}["))):
            # theirs alone: an index into the chat's messages is not one into the input.
            message = error.message.replace(ours, theirs)
            return GatewayError(error.kind, message, theirs, retry_after_s=error.retry_after_s)
    return error


def completion_job(body: CompletionRequest, request: Request, frontend: Frontend) -> OpenAIJob:
    stop = _check_common(body, frontend)
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
    frontend.limits.check_logprobs(num_logprobs, "logprobs")
    job = _new_job(body, request, "cmpl", stop, num_logprobs, frontend)
    guided = guided_from_request(body)
    num_prompt_logprobs = body.prompt_logprobs
    if body.echo and num_logprobs is not None:  # the echoed prompt's tokens get logprobs too
        num_prompt_logprobs = max(num_logprobs, num_prompt_logprobs or 0)
    return dataclasses.replace(
        job,
        num_prompt_logprobs=num_prompt_logprobs,
        guided=None if guided is None else guided[0],
        logit_bias=_logit_bias(body, frontend),
    )


def chat_job(
    body: ChatCompletionRequest, request: Request, frontend: Frontend, id_prefix: str = "chatcmpl"
) -> OpenAIJob:
    stop = _check_common(body, frontend)
    if body.functions:
        raise invalid("functions are not supported", param="functions")
    if body.function_call not in (None, "none"):
        raise invalid("function_call is not supported beyond 'none'", param="function_call")
    if body.audio is not None:
        raise invalid("audio output is not supported", param="audio")
    if body.modalities is not None and body.modalities != ["text"]:
        raise invalid("only the 'text' modality is supported", param="modalities")
    check_chat_messages(body.messages)  # /tokenize's checks too
    try:
        check_template_kwargs(
            body.chat_template_kwargs or {}, "chat_template_kwargs", OPENAI_TEMPLATE_FIELDS
        )
    except ChatRequestError as exc:
        raise invalid_from(exc) from None
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    frontend.limits.check_logprobs(num_logprobs, "top_logprobs")
    job = _new_job(body, request, id_prefix, stop, num_logprobs, frontend)
    if body.prompt_logprobs is not None and body.stream:
        raise invalid(
            "prompt_logprobs is returned with the whole chat response, not streamed",
            param="prompt_logprobs",
        )
    job = dataclasses.replace(job, num_prompt_logprobs=body.prompt_logprobs)
    plan = tool_plan(body)
    guided = guided_from_request(body)
    forced = None if plan is None else plan.guided()
    if plan is not None and forced is not None:
        if guided is not None:
            raise invalid(
                f"tool_choice {plan.mode} forces the output; {guided[1]} cannot be added",
                param=guided[1],
            )
        check(forced, "tools")
        guided = (forced, "tool_choice")
    return dataclasses.replace(
        job,
        guided=None if guided is None else guided[0],
        logit_bias=_logit_bias(body, frontend),
        tools=plan if plan is not None and plan.mode is not ToolMode.NONE else None,
        tool_call_parser=frontend.tool_call_parser,
        reasoning=frontend.reasoning_parser if guided is None else None,
    )


def _logit_bias(
    body: CompletionRequest | ChatCompletionRequest, frontend: Frontend
) -> tuple[tuple[int, float], ...]:
    vocab_size = frontend.tokenizer.vocab_size
    bias = []
    for key, value in (body.logit_bias or {}).items():
        # ASCII digits only: str.isdigit() is also true of "²", which int() refuses (a 500),
        # and a key of thousands of digits is past int()'s limit; neither can be a token id.
        digits = key.lstrip("0") or "0"
        if (
            not (key.isascii() and key.isdigit())
            or len(digits) > len(str(vocab_size))
            or int(digits) >= vocab_size
        ):
            raise invalid(
                f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise invalid(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        bias.append((int(digits), float(value)))
    return tuple(bias)


_BEAM_SEARCH_UNUSED: tuple[tuple[str, tuple[object, ...]], ...] = (
    # field, and the values that leave it unused: the search reads none of these.
    ("stop", (None, [])),
    ("stop_token_ids", (None, [])),
    ("top_p", (None, 1.0)),
    ("top_k", (None, -1, 0)),
    ("min_p", (None, 0.0)),
    ("presence_penalty", (None, 0.0)),
    ("frequency_penalty", (None, 0.0)),
    ("repetition_penalty", (None, 1.0)),
    ("min_tokens", (None, 0)),
    ("logit_bias", (None, {})),
    ("allowed_token_ids", (None,)),
    ("bad_words", (None, [])),
    ("prompt_logprobs", (None,)),
    ("logprobs", (None, False)),
    ("top_logprobs", (None,)),
    ("echo", (False,)),
    ("guided_json", (None,)),
    ("guided_regex", (None,)),
    ("guided_choice", (None,)),
    ("guided_grammar", (None,)),
    ("structured_outputs", (None,)),
    ("response_format", (None,)),
    ("tools", (None, [])),
)


def _check_beam_search(body: CompletionRequest | ChatCompletionRequest, frontend: Frontend) -> None:
    """``use_beam_search`` (vLLM's): ``n`` beams need ``2 n`` logprobs a round from the nodes, and
    a field the search would silently ignore is refused, named."""
    if not body.use_beam_search:
        if body.length_penalty is not None:
            raise invalid("length_penalty applies with use_beam_search only", "length_penalty")
        return
    max_beams = frontend.limits.max_logprobs // 2
    if body.n > max_beams:
        raise invalid(
            f"use_beam_search keeps n beams and asks the nodes for 2 n logprobs a step: n must "
            f"be <= {max_beams}, got {body.n}",
            param="n",
        )
    for name, unused in _BEAM_SEARCH_UNUSED:
        if getattr(body, name, None) not in unused:
            raise invalid(f"{name} is not supported with use_beam_search", param=name)


def _check_common(
    body: CompletionRequest | ChatCompletionRequest, frontend: Frontend
) -> tuple[str, ...]:
    """Checks shared by both routes; returns the stop strings as a tuple."""
    check_model(body.model, frontend)
    limits = frontend.limits
    if body.n > limits.max_n:
        raise invalid(f"n must be <= {limits.max_n}, got {body.n}", param="n")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options needs stream: true", param="stream_options")
    options = body.stream_options
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        # vLLM sends nothing then; a request asking for usage it will not get is a mistake.
        raise invalid(
            "stream_options.continuous_usage_stats needs include_usage: true",
            param="stream_options.continuous_usage_stats",
        )
    _check_beam_search(body, frontend)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    limits.check_stop(stop)
    limits.check_bad_words(body.bad_words or ())
    vocab_size = frontend.tokenizer.vocab_size
    for param in ("stop_token_ids", "allowed_token_ids"):
        for token_id in getattr(body, param) or ():
            if token_id >= vocab_size:
                raise invalid(
                    f"{param}: token id {token_id} is outside the vocabulary [0, {vocab_size})",
                    param=param,
                )
    return stop


def check_model(model: str | None, frontend: Frontend) -> None:
    """A request names the served model, one of its LoRA adapters, or none (a route's path
    always names one)."""
    if model is not None and model not in frontend.model_names:
        raise GatewayError(
            ErrorKind.NOT_FOUND,
            f"model {model!r} does not exist; this server serves "
            f"{', '.join(map(repr, frontend.model_names))}",
            param="model",
        )


def _new_job(
    body: CompletionRequest | ChatCompletionRequest,
    request: Request,
    id_prefix: str,
    stop: tuple[str, ...],
    num_logprobs: int | None,
    frontend: Frontend,
) -> OpenAIJob:
    request_id = request.headers.get("x-request-id")
    if request_id is None:
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    elif not CLIENT_REQUEST_ID.fullmatch(request_id):
        raise invalid("X-Request-Id must be 1 to 128 characters of [A-Za-z0-9._:-]")
    return OpenAIJob(
        body=body,
        request_id=request_id,
        arrival=request.state.arrival,
        created=int(time.time()),
        stop=stop,
        num_logprobs=num_logprobs,
        prompt_tokens_kept=frontend.limits.prompt_tokens_kept(
            body.truncate_prompt_tokens, "truncate_prompt_tokens"
        ),
    )


# --- after admission: tokens ---------------------------------------------------------------


def prompt_token_ids(job: OpenAIJob, tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """The token ids of each prompt (chat: one), checked against the vocabulary."""
    body = job.body
    if isinstance(body, ChatCompletionRequest):
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        tools = None if job.tools is None else job.tools.template_tools
        template_kwargs: dict[str, Any] = {}
        if body.reasoning_effort is not None:
            template_kwargs["reasoning_effort"] = body.reasoning_effort
        template_kwargs |= {**(body.chat_template_kwargs or {}), "tools": tools}
        prompts = [
            tokenizer.encode_chat(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                add_special_tokens=body.add_special_tokens,
                **template_kwargs,
            )
        ]
        param = "messages"
    else:
        prompt = body.prompt
        param = "prompt"
        special = body.add_special_tokens
        if isinstance(prompt, str):
            prompts = [tokenizer.encode(prompt, special)]
        elif isinstance(prompt[0], str):
            prompts = [tokenizer.encode(text, special) for text in prompt]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = [list(ids) for ids in prompt]
    if job.prompt_tokens_kept is not None:  # vLLM's left truncation
        prompts = [ids[-job.prompt_tokens_kept :] for ids in prompts]
    check_prompt_ids(prompts, tokenizer.vocab_size, param)
    return [tuple(ids) for ids in prompts]


def choice_requests(
    job: OpenAIJob, prompts: list[tuple[int, ...]], frontend: Frontend
) -> list[GenerationRequest]:
    """One request per choice, in choice order (prompt ``p``'s ``n`` choices at ``p * n + i``);
    the ids are ``{request_id}-{index}`` when there is more than one. Only choice ``p * n`` asks
    for prompt ``p``'s prompt logprobs."""
    n = job.body.n
    num_choices = len(prompts) * n
    timeout_s = frontend.request_timeout_s
    deadline = None if timeout_s is None else job.arrival + timeout_s
    # Tokenized here, on the event loop: at most max_bad_words short words (limits.py).
    bad_words = bad_words_token_ids(frontend.tokenizer.encode_text, job.body.bad_words or ())
    requests = []
    for prompt_index, prompt in enumerate(prompts):
        for choice in range(n):
            index = prompt_index * n + choice
            requests.append(
                GenerationRequest(
                    request_id=job.request_id if num_choices == 1 else f"{job.request_id}-{index}",
                    prompt_token_ids=prompt,
                    sampling=sampling_params(job, len(prompt), choice, frontend, bad_words),
                    deadline=deadline,
                    arrival=job.arrival,
                )
            )
    return requests


def sampling_params(
    job: OpenAIJob,
    prompt_len: int,
    choice: int,
    frontend: Frontend,
    bad_words: tuple[tuple[int, ...], ...],
) -> SamplingParams:
    """``bad_words``: the request's ``bad_words`` as token sequences (``services.bad_words``)."""
    body = job.body
    limits = frontend.limits
    param = "messages" if job.is_chat else "prompt"
    requested, max_param = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        requested, max_param = body.max_completion_tokens, "max_completion_tokens"
    defaults = frontend.sampling_defaults  # the model's, for what the request leaves unset
    if requested is None:
        room = limits.output_room(prompt_len, param)
        default = limits.max_tokens if job.is_chat else _COMPLETIONS_DEFAULT_MAX_TOKENS
        if defaults.max_tokens is not None:
            default = defaults.max_tokens
        max_tokens = min(default, room, limits.max_tokens)
    else:
        limits.check_max_tokens(requested, prompt_len, prompt_param=param, max_param=max_param)
        max_tokens = requested
    seed = None
    if body.seed is not None:
        # seed + choice: the n choices differ, and each stays reproducible; wrapped into int64.
        seed = (body.seed + choice + _INT64) % (2 * _INT64) - _INT64
    # 0, or a top_k the vocabulary cannot fill, filters nothing: -1, the engine's "off" (a top_k
    # past int32 would fail the nodes' protobuf field, after the request was accepted).
    top_k = body.top_k if body.top_k is not None else defaults.top_k
    if top_k is not None and (top_k == 0 or top_k >= frontend.tokenizer.vocab_size):
        top_k = -1
    # A field the client left out (or sent as null) takes the model's default, else the engine's.
    given: dict[str, Any] = {
        "temperature": body.temperature if body.temperature is not None else defaults.temperature,
        "top_k": top_k,
        "top_p": body.top_p if body.top_p is not None else defaults.top_p,
        "repetition_penalty": (
            body.repetition_penalty
            if body.repetition_penalty is not None
            else defaults.repetition_penalty
        ),
        "min_p": body.min_p if body.min_p is not None else defaults.min_p,
    }
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens or 0,
            seed=seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=job.num_logprobs,
            # The n choices of a prompt share its prompt logprobs: its first choice asks for
            # them (a prefill that scores every prompt position, and that prefix caching must
            # not skip), the others are copied them (generation_response.py) and may reuse the
            # prompt's cached blocks.
            prompt_logprobs=job.num_prompt_logprobs if choice == 0 else None,
            guided=job.guided,
            logit_bias=job.logit_bias,
            allowed_token_ids=tuple(body.allowed_token_ids or ()),
            priority=body.priority or 0,
            bad_words_token_ids=bad_words,
            cache_salt=body.cache_salt,
            lora_name=frontend.lora_name(body.model),
            **{name: value for name, value in given.items() if value is not None},
        )
    except SamplingParamError as exc:
        raise invalid(str(exc), param=exc.param) from None
    conflict = params.bad_words_conflict()
    if conflict is not None:  # the engine's refusal, here before routing (bad_words: its words)
        raise invalid(conflict, param="bad_words")
    conflict = params.min_tokens_conflict(frontend.tokenizer.eos_token_ids)
    if conflict is not None:
        raise invalid(conflict, param="allowed_token_ids")
    return params
