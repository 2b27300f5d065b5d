"""OpenAI's Responses API wire format (``POST /v1/responses``), the part this server takes: text
in (a string, or messages of text parts, with ``instructions``), text or JSON out, whole or
streamed as events.

Requests are strict like the other routes' (``openai_protocol.py``). Fields of OpenAI's API
that need what this server does not have (built-in tools, background mode) are declared so that
their refusal names them. Function tools run as the chat route's tools: the calls come out
as ``function_call`` items, and a client sends them back with its ``function_call_output`` items.
Responses are stored for ``previous_response_id`` (``response_store.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from gateway.http_api.openai_protocol import (
    Flag,
    NonEmptyText,
    RequestModel,
    ResponseModel,
    Text,
    TokenLogprobInfo,
)
from services.types import MAX_LOGPROBS


class InputTextPart(RequestModel):
    type: Literal["input_text", "output_text"]
    """``output_text``: a part of an earlier response's message, sent back as context."""
    text: Text
    annotations: list[Any] | None = None
    """Of an ``output_text`` part sent back: ignored."""
    logprobs: list[Any] | None = None
    """Of an ``output_text`` part sent back: ignored."""


class InputItemBase(RequestModel):
    """What every input item may carry when it was an earlier response's output sent back."""

    id: str | None = None
    """Ignored."""
    status: str | None = None
    """Ignored."""


class InputMessage(InputItemBase):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[InputTextPart], Field(min_length=1)]


class FunctionCallItem(InputItemBase):
    """A function call of an earlier response, sent back as context."""

    type: Literal["function_call"]
    call_id: NonEmptyText
    name: NonEmptyText
    arguments: Text


class FunctionCallOutputItem(InputItemBase):
    """The client's result of a function call (``call_id``), for the model to read."""

    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Text


class ReasoningItem(InputItemBase):
    """A reasoning item of an earlier response sent back (as clients replay whole outputs):
    accepted and left out of the prompt, as thinking models' templates drop earlier turns'
    reasoning."""

    type: Literal["reasoning"]
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None


def _item_kind(value: Any) -> str:
    """An input item's model, by its type (a message may leave it out): so that a bad item's
    error names its own fields; an unknown type goes to the message model, which names it."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    known = ("function_call", "function_call_output", "reasoning")
    return f"item:{kind if kind in known else 'message'}"


# Tags as kind:name: an error's field path leaves them out (openai_errors._field_path).
InputItem = Annotated[
    Annotated[InputMessage, Tag("item:message")]
    | Annotated[FunctionCallItem, Tag("item:function_call")]
    | Annotated[FunctionCallOutputItem, Tag("item:function_call_output")]
    | Annotated[ReasoningItem, Tag("item:reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(RequestModel):
    type: Literal["function"]
    """Only function tools: OpenAI's built-in ones (web search, file search...) are not here."""
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """Accepted: a named or required tool choice follows the schema exactly anyway."""


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    name: NonEmptyText


class ReasoningOptions(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    """Given to the chat template as ``reasoning_effort`` (gpt-oss's templates read it; others
    ignore it)."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Accepted: no summaries are written (a reasoning item's ``summary`` is empty)."""


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """With ``json_schema``: the schema the output follows."""
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None
    """Accepted and ignored."""


LOGPROBS_INCLUDE = "message.output_text.logprobs"

Includable = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]
"""OpenAI's ``include`` values (the SDK's ``ResponseIncludable``)."""


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: Annotated[
        Annotated[NonEmptyText, Tag("str")]
        | Annotated[list[InputItem], Field(min_length=1), Tag("list")],
        # Chosen by the JSON type, so that a bad item's error names it (input[0].role).
        Discriminator(lambda value: "str" if isinstance(value, str) else "list"),
    ]
    instructions: Text | None = None
    """A system message before the input."""
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: Flag = False
    text: TextConfig | None = None
    store: bool | None = None
    """False: the response is not kept for ``previous_response_id`` or ``GET`` (default: kept,
    while the gateway stores responses: ``--responses-store-size``)."""
    metadata: dict[str, str] | None = None
    """Returned with the response."""
    user: str | None = None
    cache_salt: NonEmptyText | None = None
    """vLLM extension: as the chat API's ``cache_salt``."""
    parallel_tool_calls: bool | None = None
    """False: at most one function call per response. Default true."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """As the chat route's: ``auto`` (default with tools), ``none``, ``required`` or a named
    function (``{"type": "function", "name": ...}``)."""
    tools: list[FunctionTool] | None = None
    """Function tools, as the chat route takes them."""
    previous_response_id: str | None = None
    """A stored response this one continues: its conversation comes before ``input``."""
    reasoning: ReasoningOptions | None = None
    include: list[Includable] | None = None
    """``message.output_text.logprobs``: each output token's logprob (with ``top_logprobs``
    alternatives) on the text. OpenAI's other values are accepted and change nothing: they ask
    for parts of outputs this server never makes (its built-in tools' results, images, encrypted
    reasoning, which the Agents SDK asks for when it does not store responses)."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """With ``include`` logprobs: alternatives per token."""
    truncation: Literal["disabled", "auto"] | None = None
    """Only ``disabled``: a prompt past the context is refused, never cut."""
    background: bool | None = None
    """Only false: a response is answered while the request waits (or streams)."""
    service_tier: str | None = None
    """Accepted and ignored: every request is served alike."""
    prompt_cache_key: str | None = None
    """Accepted and ignored: prefix-affine routing finds a prompt's cache by its tokens."""
    safety_identifier: str | None = None
    """Accepted and ignored (OpenAI's abuse monitoring)."""
    max_tool_calls: int | None = Field(None, ge=1)
    """Accepted: it bounds calls to built-in tools, which this server does not have."""
    stream_options: dict[str, Any] | None = None
    """Accepted and ignored (``include_obfuscation``: no obfuscation is added)."""


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprobInfo] = Field(default_factory=list)
    """With ``include: ["message.output_text.logprobs"]``: each token's; else empty."""


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(ResponseModel):
    """What a thinking model wrote before its answer (the gateway's ``--reasoning-parser``)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    """Empty: no summaries are written."""
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class OutputFunctionCall(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    """What the client's ``function_call_output`` names."""
    name: str
    arguments: str
    """JSON text."""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(ResponseModel):
    code: str
    message: str


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    model: str
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    """The request's reasoning options, as given."""
    store: bool = False
    """Whether this response is kept (``GET /v1/responses/{id}``, ``previous_response_id``)."""


class ResponseDeleted(ResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
