"""Chat templates: a model's Jinja template compiled in transformers' sandbox, and a
conversation rendered with it as vLLM renders one.

Messages arrive as OpenAI chat messages (from the HTTP bridge, or built from the gRPC API's) and
reach the template as vLLM passes them: content is a string (a list of ``{"type": "text"}``
parts is joined with newlines; an assistant turn that only called tools has ``""``), and an
assistant turn's tool call arguments, JSON text on the wire, are parsed into the object
templates iterate over. Anything that cannot be rendered is a ``ChatRequestError`` naming the
request's field (the gateway answers it as a 400 before any node sees the request; the offline
``LLM.chat`` raises it). Shared by both: torch-free, like the gateway.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Message roles the chat APIs take (the OpenAI bridge's and the gRPC API's): OpenAI's, less its
deprecated ``function`` (function calling is not supported; tools are). Any other is refused
before rendering."""
# Appended to the final message to find its end in the rendered text (transformers' marker).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: training templates mark assistant text with it.

    transformers uses the marks to build an assistant mask; serving only needs the text inside.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, which could reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Jinja's own signature trick, so that ``namespace(self=...)`` still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON (transformers').
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatRequestError(ValueError):
    """A conversation the template cannot render: bad messages, or the template refused them;
    ``param`` names the request's field (``messages[2].content``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or (``check_renders``) cannot render a plain
    conversation; the message says where, the caller which file or flag."""


_PROBE_MESSAGES = ({"role": "user", "content": "Hello"},)
"""The conversation a template given at start-up must render: any chat model takes it."""


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile ``source`` in the sandbox transformers renders chat templates in.

    Templates come from model repositories and are untrusted code: the immutable sandbox keeps
    them from mutating their inputs or reaching Python internals. ``ChatTemplateError`` for a
    template that is not valid Jinja.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    # NOTE: transformers' `dict` global is a restricted callable; a plain function is as safe.
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat_template is not valid Jinja: {exc.message} (line {exc.lineno})"
        ) from None


def message_text(index: int, role: str, content: object) -> str:
    """The text of one message's content; the offending message is named in the error."""
    if content is None:
        if role == "assistant":
            # An assistant turn that only called tools (the OpenAI SDK replays it with content
            # null). vLLM renders it as "": ChatML-style templates concatenate the content, and
            # a missing key fails them (transformers would leave the key out).
            return ""
        where = f"messages[{index}].content"
        raise ChatRequestError(f"{where}: a {role} message needs content", param=where)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatRequestError(
            f"messages[{index}].content must be a string or a list of text parts, "
            f"got {type(content).__name__}",
            param=f"messages[{index}].content",
        )
    texts = []
    for part_index, part in enumerate(content):
        where = f"messages[{index}].content[{part_index}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatRequestError(
                f"{where} has type {kind!r}; this model accepts only text parts",
                param=f"{where}.type" if isinstance(part, dict) else where,
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatRequestError(f"{where}.text must be a string", param=f"{where}.text")
        texts.append(text)
    # vLLM joins text parts with newlines when a template takes string content.
    return "\n".join(texts)


def _template_tool_calls(index: int, tool_calls: object) -> list[dict[str, Any]] | None:
    """An assistant turn's tool calls with their arguments as objects, as vLLM passes them.

    OpenAI sends ``function.arguments`` as JSON text; tool-use templates (transformers' own
    convention) iterate over it as a mapping (``arguments|items``). Text that is not JSON becomes
    ``{}`` as in vLLM: a client replaying a call the model wrote badly keeps its conversation.
    An empty list is dropped, so that templates take their plain assistant path.
    """
    if not isinstance(tool_calls, list):
        where = f"messages[{index}].tool_calls"
        raise ChatRequestError(f"{where} must be a list", param=where)
    calls = []
    for call_index, call in enumerate(tool_calls):
        where = f"messages[{index}].tool_calls[{call_index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatRequestError(f"{where} needs a 'function' object with a 'name'", param=where)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = {}
        elif not isinstance(arguments, (dict, list)):
            arguments = {}
        # Copies: the caller's message (and its JSON text) stays as it came.
        calls.append({**call, "function": {**function, "arguments": arguments}})
    return calls or None


def _cut_at_continue_tag(rendered: str, final_text: str) -> str:
    """The rendered conversation up to the end of its final message (``_CONTINUE_TAG``)."""
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatRequestError(
            "continue_final_message: the chat template does not render the final message as "
            "it was given, so it cannot be continued",
            param="continue_final_message",
        )
    tag_at = rendered.rindex(tag)
    if rendered.startswith(_CONTINUE_TAG, tag_at):
        return rendered[:tag_at]
    # The template trimmed the message's trailing space (and the tag's): trim as it did.
    return rendered[:tag_at].rstrip()


def normalize_messages(messages: object) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: plain string content, tool call arguments as
    objects, no ``None`` values (templates handle a missing key, not a None).
    """
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list", param="messages")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatRequestError(
                f"messages[{index}] must be an object, got {type(message).__name__}",
                param=f"messages[{index}]",
            )
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            where = f"messages[{index}].role"
            raise ChatRequestError(
                f"{where}: {role!r} is not one of {', '.join(ROLES)}", param=where
            )
        fields = {key: value for key, value in message.items() if value is not None}
        fields["content"] = message_text(index, role, message.get("content"))
        if role == "assistant" and "tool_calls" in fields:
            tool_calls = _template_tool_calls(index, fields.pop("tool_calls"))
            if tool_calls is not None:
                fields["tool_calls"] = tool_calls
        normalized.append(fields)
    return normalized


RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "add_special_tokens",
    }
)
"""Template variables a client's ``chat_template_kwargs`` may not set: the gateway sets each
from a field of its own (vLLM refuses ``chat_template`` and ``tokenize`` there, and fails on a
second ``messages`` or ``tools``)."""


OPENAI_TEMPLATE_FIELDS = {
    name: name
    for name in (
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
    )
}
"""The OpenAI-style request's own fields for the reserved variables (the gateway's chat route and
``/tokenize``): ``check_template_kwargs``'s ``own_fields`` there."""


def check_template_kwargs(
    kwargs: Mapping[str, Any], param: str, own_fields: Mapping[str, str]
) -> None:
    """Refuses a reserved name in ``kwargs`` (the request's ``param``); ``own_fields`` maps a
    reserved variable to the request field that sets it, for the error's hint."""
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            field = own_fields.get(key)
            hint = f"; use the request's {field!r} field" if field is not None else ""
            raise ChatRequestError(
                f"{param} cannot set {key!r}: the server sets it{hint}", param=param
            )


class ChatTemplate:
    """A model's chat template, compiled once, with the special tokens every render gets."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self._template = compile_chat_template(source)
        self._special_tokens = dict(special_tokens)

    def check_renders(self) -> None:
        """``ChatTemplateError`` unless a one-message conversation renders to some text: a
        template given at start-up (``--chat-template``) is refused there, not on every chat."""
        try:
            rendered = self.render([dict(message) for message in _PROBE_MESSAGES])
        except ChatRequestError as exc:
            cause = exc.__cause__
            problem = str(exc) if cause is None else f"{type(cause).__name__}: {cause}"
            raise ChatTemplateError(
                f"cannot render a conversation of one user message: {problem}"
            ) from None
        if not rendered.strip():
            raise ChatTemplateError("renders a conversation of one user message as no text")

    def render(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` as transformers does.

        ``continue_final_message``: the text ends inside the last message, without what the
        template writes after it (end of turn), so the model continues it; it excludes the
        generation prompt. ``template_kwargs`` reach the template as variables (``tools``,
        ``enable_thinking``...; any name, ``self`` included: the parameters before them are
        positional-only) and override the special tokens of the same name.
        """
        if continue_final_message and add_generation_prompt:
            # vLLM (through transformers) refuses both too; add_generation_prompt defaults to
            # true on the OpenAI bridge.
            raise ChatRequestError(
                "continue_final_message needs add_generation_prompt: false (the model continues "
                "the last message instead of starting a new turn)",
                param="continue_final_message",
            )
        normalized = normalize_messages(messages)
        final_text = normalized[-1]["content"]
        if continue_final_message:
            # transformers' way: mark the end of the final message, render, cut at the mark.
            normalized[-1]["content"] = final_text + _CONTINUE_TAG
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update(self._special_tokens)
        variables.update(template_kwargs)
        try:
            # One mapping, not keywords: a variable may be named like render's own "self".
            variables.update(messages=normalized, add_generation_prompt=add_generation_prompt)
            rendered = self._template.render(variables)
        except jinja2.TemplateError as exc:
            # raise_exception() in a template is how models refuse a conversation they cannot
            # take (e.g. roles that do not alternate): the client's request is at fault.
            raise ChatRequestError(
                f"the chat template rejected the messages: {exc}", "messages"
            ) from exc
        except Exception as exc:
            # The template is untrusted code run on the client's values (messages, tool call
            # arguments, chat_template_kwargs): "'a' + none" or "3|items" fail it in plain
            # Python. vLLM answers any failure of it with a 400, and so does the gateway.
            raise ChatRequestError(
                f"the chat template rejected the messages: {type(exc).__name__}: {exc}",
                "messages",
            ) from exc
        if continue_final_message:
            rendered = _cut_at_continue_tag(rendered, final_text)
        return rendered
