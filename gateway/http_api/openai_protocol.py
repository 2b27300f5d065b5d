"""The OpenAI-compatible wire format: request and response bodies of ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/models``, as pydantic models.

Requests are strict: a wrong JSON type is refused, not coerced (``"max_tokens": "5"`` is a 400),
an unknown field is refused rather than silently ignored, and non-finite floats are refused.
Static ranges are declared here so the OpenAPI document states them; the bounds that depend on
the deployment (``RequestLimits``, the prompt's length) are checked by the app.

vLLM's sampling extensions are accepted: ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``bad_words``, ``priority``, ``return_tokens_as_token_ids``,
``add_special_tokens``, ``use_beam_search`` with ``length_penalty``.
Structured outputs: ``response_format`` (json_object, json_schema), vLLM's
``structured_outputs`` and its older ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``; tools with ``tool_choice``; and ``logit_bias``. Chat takes vLLM's template
controls too: ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``
and ``echo``; streams take ``stream_options.continuous_usage_stats``. Fields that exist only to
be refused (``suffix``, ``functions``, ...) are declared so that the refusal names them with a
message saying what is unsupported.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from services.types import MAX_LOGPROBS


def _check_utf8(text: str) -> str:
    # JSON can spell a lone surrogate ("\ud800"); no tokenizer or UTF-8 encoder takes one.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"not valid Unicode: a lone surrogate at index {error.start}") from None
    return text


Text = Annotated[str, AfterValidator(_check_utf8)]
"""A string that can reach the tokenizer: valid Unicode."""
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_check_utf8)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _null_means(default: object, kind: Any) -> BeforeValidator:
    """``null`` is the default, as OpenAI takes it for optional parameters (clients send it).
    ``kind`` is a type or a typing form (``Annotated[...]``): Any, as no annotation spans both."""
    return BeforeValidator(
        lambda value: default if value is None else value, json_schema_input_type=kind | None
    )


Flag = Annotated[bool, _null_means(False, bool)]
TrueFlag = Annotated[bool, _null_means(True, bool)]
FinishReasonName = Literal["stop", "length", "abort", "error", "tool_calls"]
Role = Literal["system", "developer", "user", "assistant", "tool"]


class RequestModel(BaseModel):
    # use_attribute_docstrings: the docstrings below become the OpenAPI document's descriptions.
    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True
    )


class ResponseModel(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)


class StreamOptions(RequestModel):
    include_usage: bool = False
    """Send a last chunk with ``choices: []`` and the usage of the whole request."""
    continuous_usage_stats: Flag = False
    """vLLM extension, with ``include_usage``: every chunk also carries the usage so far (its
    choice's completion tokens)."""


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs`` (which replaced its ``guided_*`` fields in v0.12): exactly one
    of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``."""

    json_spec: dict[str, Any] | Text | None = Field(None, alias="json")
    """A JSON schema, as an object or as JSON text."""
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    """A Lark grammar (llguidance's dialect)."""
    json_object: bool | None = None
    """True: any JSON object."""
    disable_any_whitespace: Flag = False
    """Accepted either way: JSON output here never has whitespace between its tokens."""
    disable_additional_properties: Flag = False
    """Objects of the schema that do not say otherwise take no properties beyond theirs."""
    whitespace_pattern: str | None = None
    """Unsupported: only null."""
    structural_tag: str | None = None
    """Unsupported: only null."""


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, use_attribute_docstrings=True)

    type: str
    """``text``, ``json_object`` or ``json_schema``."""
    json_schema: dict[str, Any] | None = None
    """With ``json_schema``: ``{"name": ..., "schema": {...}, "strict": ...}``."""


class _GenerationParams(RequestModel):
    """Parameters shared by completions and chat completions."""

    model: str | None = None
    """The served model's name (``GET /v1/models``); left out or null, the served model (as
    vLLM)."""
    n: Annotated[int, Field(ge=1), _null_means(1, Annotated[int, Field(ge=1)])] = 1
    """Choices to generate (concurrently). With a seed, choice ``i`` samples with ``seed + i``,
    so the choices differ and each one is reproducible."""
    stream: Flag = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    """-1 or 0: off (vLLM takes both)."""
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: Flag = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: TrueFlag = True
    include_stop_str_in_output: Flag = False
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) → bias in [-100, 100], added to that token's logit."""
    allowed_token_ids: TokenIds | None = None
    """vLLM extension: only these token ids may be sampled."""
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """vLLM extension: each prompt token's logprob given the tokens before it, with this many
    alternatives (``prompt_logprobs`` of a completion choice, of a chat response). Such a prompt
    is computed whole, past the prefix cache."""
    guided_json: dict[str, Any] | None = None
    """vLLM extension: constrain the output to this JSON schema."""
    guided_regex: str | None = None
    """vLLM extension: constrain the output to match this regular expression in full."""
    guided_choice: list[str] | None = None
    """vLLM extension: the output is exactly one of these strings."""
    guided_grammar: str | None = None
    """vLLM extension: constrain the output to this Lark grammar (llguidance's dialect)."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM extension (its current form of the ``guided_*`` fields): one constraint."""
    response_format: ResponseFormat | None = None
    """OpenAI's structured output: ``json_object`` or ``json_schema``; ``text`` constrains
    nothing. Completions take it too, as vLLM's do."""
    return_tokens_as_token_ids: Flag = False
    """vLLM extension: logprobs name each token ``token_id:<id>`` instead of by its text."""
    bad_words: list[NonEmptyText] | None = None
    """vLLM extension: words never to generate, at the start of the output or after a space
    (each word's token spellings are banned where they would complete)."""
    priority: int | None = Field(None, ge=-(2**31), lt=2**31)
    """vLLM extension: lower values are scheduled first, on nodes started with
    ``--scheduling-policy priority``; a non-zero priority is refused (400) under ``fcfs``."""
    truncate_prompt_tokens: int | None = None
    """vLLM extension: keep only the prompt's last k tokens (left truncation); -1 keeps
    ``max_model_len`` of them."""
    cache_salt: NonEmptyText | None = None
    """vLLM extension: salts the prompt's prefix-cache blocks, which are then shared only with
    requests of the same salt (a client cannot learn from a fast first token that another sent
    the same prompt). Give each tenant a long random salt (e.g. 256 bits, base64)."""
    user: str | None = None
    """Accepted and ignored (OpenAI uses it for abuse monitoring)."""
    use_beam_search: Flag = False
    """vLLM extension: each prompt's ``n`` choices are its ``n`` best beams (``n`` at most half
    of ``max_logprobs``), searched by rounds of one-token requests to the nodes (the prefix
    cache serves what the beams share); a choice's text is sent whole once the search ends,
    also when streaming. ``temperature`` draws one more candidate per beam; ``max_tokens``,
    ``ignore_eos``, ``include_stop_str_in_output``, ``seed`` and ``length_penalty`` apply. The
    sampling and output fields the search does not use are refused with it."""
    length_penalty: float | None = None
    """vLLM extension, with ``use_beam_search``: a beam's score is ``cum_logprob / num_tokens **
    length_penalty`` (default 1; above 0 favours longer beams)."""


class CompletionRequest(_GenerationParams):
    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    """A string, a batch of strings, a list of token ids, or a batch of token-id lists. Choice
    ``p * n + i`` is the ``i``-th choice of prompt ``p``."""
    max_tokens: int | None = Field(None, ge=1)
    """Default 16 (as OpenAI), lowered when the prompt leaves less room."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Top-n alternatives per token, in the legacy completions format."""
    echo: Flag = False
    """Start each choice's text with its prompt; with ``logprobs``, the legacy logprobs start
    with the prompt's tokens too (the first has none), as lm-evaluation-harness reads them."""
    add_special_tokens: TrueFlag = True
    """vLLM extension: a text prompt is tokenized with the tokenizer's special tokens (BOS);
    false for a prompt that already holds them."""
    suffix: str | None = None
    """Unsupported: only null or empty."""
    best_of: int | None = Field(None, ge=1)
    """Unsupported beyond ``best_of == n``."""


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported.
    Other parts (images, audio, files) parse, so that their refusal can name them."""

    model_config = ConfigDict(extra="allow", strict=True, use_attribute_docstrings=True)

    type: str
    text: Text | None = None


class ChatMessage(RequestModel):
    role: Role
    content: Text | list[ContentPart] | None = None
    """Text parts of a list are joined with newlines. An assistant turn may leave it null (it
    only called tools): the template gets ``""``."""
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant turn's tool calls; the template gets each ``function.arguments`` parsed
    from its JSON text into an object (``{}`` when it is not JSON), as vLLM passes them."""
    tool_call_id: Text | None = None
    """A tool message: the call it answers."""


class ChatCompletionRequest(_GenerationParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI in favour of ``max_completion_tokens``, which wins when both are set.
    Default: what is left of the context after the prompt, capped by the server's limit."""
    max_completion_tokens: int | None = Field(None, ge=1)
    add_special_tokens: Flag = False
    """vLLM extension: add the tokenizer's special tokens (BOS) on top of what the chat
    template writes (most templates write their own)."""
    logprobs: Flag = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Alternatives per token; needs ``logprobs: true``."""
    tools: list[dict[str, Any]] | None = None
    """``{"type": "function", "function": {"name", "description", "parameters"}}`` each."""
    tool_choice: str | dict[str, Any] | None = None
    """``none``, ``auto`` (default with tools), ``required`` or a named function."""
    parallel_tool_calls: bool | None = None
    """False: at most one call per turn. Default true."""
    functions: list[dict[str, Any]] | None = None
    """Unsupported (deprecated by OpenAI): only null or empty."""
    function_call: str | dict[str, Any] | None = None
    """Unsupported beyond ``"none"``."""
    audio: dict[str, Any] | None = None
    """Unsupported: only null."""
    modalities: list[str] | None = None
    """Only ``["text"]``."""
    add_generation_prompt: TrueFlag = True
    """vLLM extension: end the prompt with the template's opening of an assistant turn. False:
    the response's role is the last message's."""
    continue_final_message: Flag = False
    """vLLM extension: the model continues the last message (no end of turn after it, no
    generation prompt: needs ``add_generation_prompt: false``)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM extension: extra variables for the chat template, e.g. ``{"enable_thinking":
    false}``. Names the server sets itself (``messages``, ``tools``...) are refused."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    """OpenAI's: the chat template's ``reasoning_effort`` (gpt-oss's templates read it, others
    ignore it), as vLLM passes it; a ``chat_template_kwargs`` value of the same name wins."""
    store: bool | None = None
    """Accepted and ignored: nothing is stored."""
    metadata: dict[str, str] | None = None
    """Accepted and ignored (OpenAI keeps it with stored completions)."""
    service_tier: str | None = None
    """Accepted and ignored: every request is served alike."""
    include_reasoning: TrueFlag = True
    """vLLM extension, with ``--reasoning-parser``: false leaves ``reasoning_content`` out (the
    reasoning is still generated, and counted)."""
    echo: Flag = False
    """vLLM extension: when the last message has the response's role (``assistant`` with the
    generation prompt, else any), its content starts the response's content."""


class ErrorDetail(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorDetail


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int
    """Counted once per prompt, however many choices it has (as OpenAI counts)."""
    completion_tokens: int
    """Summed over all choices."""
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)
    """Characters into the choice's text where each token starts."""


class PromptLogprob(ResponseModel):
    """vLLM's ``Logprob``: one token's logprob at one prompt position."""

    logprob: float
    rank: int | None = None
    """Its rank in the vocabulary (1 = most likely): an alternative's place, the prompt token's
    1 + the tokens with a greater logprob; None only from a node that sends no ranks."""
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""Per prompt token (the first None): the token's and its alternatives' logprobs, by id."""


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = Field(
        default=None, exclude_if=lambda value: value is None
    )
    """vLLM extension, with the request's ``prompt_logprobs`` (streamed: in the choice's first
    chunk)."""
    finish_reason: FinishReasonName | None = None
    stop_reason: int | str | None = None
    """vLLM extension: the stop string or stop token id that ended the choice."""


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprobInfo] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(ResponseModel):
    index: int
    """Which call of the choice this fragment belongs to."""
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatResponseMessage(ResponseModel):
    role: Role = "assistant"
    """``assistant``; without the generation prompt, the last message's role (as vLLM)."""
    reasoning_content: str | None = Field(default=None, exclude_if=lambda value: value is None)
    """vLLM extension, with ``--reasoning-parser``: the model's ``<think>`` text."""
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda value: value is None)
    """Left out of the JSON when the message has none, as OpenAI does."""


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = Field(
        default=None, exclude_if=lambda value: value is None
    )
    """vLLM extension, with the request's ``prompt_logprobs``: the conversation's prompt."""


class ChatDelta(ResponseModel):
    """A field left None is not sent, as OpenAI and vLLM do (``{"content": " Paris"}``; the
    finish chunk's ``{}``): a strict client's schema may not take ``"role": null``."""

    role: Role | None = Field(default=None, exclude_if=lambda value: value is None)
    """Sent once, in a choice's first chunk, together with its first content."""
    reasoning_content: str | None = Field(default=None, exclude_if=lambda value: value is None)
    """vLLM extension, with ``--reasoning-parser``: the next piece of the ``<think>`` text."""
    content: str | None = Field(default=None, exclude_if=lambda value: value is None)
    tool_calls: list[ToolCallDelta] | None = Field(
        default=None, exclude_if=lambda value: value is None
    )


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int
    root: str
    """vLLM's: the model every served name stands for; here its first served name (vLLM gives
    the path it loaded, which on pdserve is on the nodes' disks, not the client's business)."""
    parent: str | None = None
    """vLLM's: a LoRA adapter's base model (its first served name); null for the model's own
    names."""


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's ``POST /v1/load_lora_adapter`` (``--allow-runtime-lora-updating``)."""

    lora_name: str
    """The name requests give as their ``model`` to run with the adapter."""
    lora_path: str
    """A PEFT adapter directory as the nodes' hosts see it."""
    load_inplace: Flag = False
    """vLLM's reload of a loaded name from new files; refused here (unload it first)."""


class UnloadLoRAAdapterRequest(RequestModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` (``--allow-runtime-lora-updating``)."""

    lora_name: str
    lora_int_id: int | None = None
    """vLLM's; the name alone says which adapter."""
