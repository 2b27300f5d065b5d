"""The model's tokenizer and chat template, loaded without transformers.

The gateway image has no torch or transformers, so this module reads the model itself. A GGUF
file (or a directory holding one) carries vocabulary, special tokens and chat template in its
metadata (``services.gguf_tokenizer`` rebuilds the tokenizer). A Hugging Face model directory
gives ``tokenizer.json`` (read through the ``tokenizers`` library), ``tokenizer_config.json``
for the named special tokens and the chat template (``chat_template.jinja`` wins when present, as
in transformers 5), and ``generation_config.json`` for extra EOS ids. Encoding, decoding and
template rendering match ``transformers.AutoTokenizer`` on the same model; the tests check it.

Messages arrive as OpenAI chat messages and reach the template as vLLM passes them: content is a
string (a list of ``{"type": "text"}`` parts is joined with newlines; an assistant turn that
only called tools has ``""``), and an assistant turn's tool call arguments, JSON text on the
wire, are parsed into the object templates iterate over. Anything the gateway cannot render is a
``GatewayError`` naming ``messages``, raised before any node sees the request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfTokenizer

from gateway.errors import invalid
from services.gguf_tokenizer import gguf_tokenizer_parts
from services.models.gguf_file import find_gguf, open_gguf

logger = logging.getLogger(__name__)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
"""Message roles the OpenAI chat API defines; any other is refused before rendering."""

# The named special tokens transformers passes to every chat template (its
# SPECIAL_TOKENS_ATTRIBUTES); extra special tokens are not passed.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Byte fallback tokens of SentencePiece-style vocabularies, e.g. "<0xE2>".
_BYTE_FALLBACK_PREFIX = "<0x"
# The word-boundary marker of SentencePiece-style vocabularies.
_METASPACE = "\u2581"
# Appended to the final message to find its end in the rendered text (transformers' marker).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters of byte-level BPE back to bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    stand_ins = list(printable)
    num_shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            stand_ins.append(256 + num_shifted)
            num_shifted += 1
    return {chr(char): byte for byte, char in zip(printable, stand_ins, strict=True)}


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


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile ``source`` in the sandbox transformers renders chat templates in.

    Templates come from model repositories and are untrusted code: the immutable sandbox keeps
    them from mutating their inputs or reaching Python internals.
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
    return env.from_string(source)


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = value.get("content")
        if isinstance(content, str):
            return content
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, expected a JSON object")
    return data


def _read_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    # transformers 5 loads chat_template.jinja over the config's key; newer checkpoints ship it.
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: serving uses the default one, as transformers does.
        named = {item.get("name"): item.get("template") for item in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _message_text(index: int, role: str, content: object) -> str:
    """The text of one message's content; the offending message is named in the error."""
    if content is None:
        if role == "assistant":
            # An assistant turn that only called tools (the OpenAI SDK replays it with content
            # null). vLLM renders it as "": ChatML-style templates concatenate the content, and
            # a missing key fails them (transformers would leave the key out).
            return ""
        raise invalid(f"messages[{index}] ({role}) has no content", param="messages")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(
            f"messages[{index}].content must be a string or a list of text parts, "
            f"got {type(content).__name__}",
            param="messages",
        )
    texts = []
    for part_index, part in enumerate(content):
        where = f"messages[{index}].content[{part_index}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(
                f"{where} has type {kind!r}; this model accepts only text parts",
                param="messages",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}.text must be a string", param="messages")
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
        raise invalid(f"messages[{index}].tool_calls must be a list", param="messages")
    calls = []
    for call_index, call in enumerate(tool_calls):
        where = f"messages[{index}].tool_calls[{call_index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{where} needs a 'function' object with a 'name'", param="messages")
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
        raise invalid(
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
        raise invalid("messages must be a non-empty list", param="messages")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(
                f"messages[{index}] must be an object, got {type(message).__name__}",
                param="messages",
            )
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(
                f"messages[{index}] has role {role!r}; expected one of {sorted(ROLES)}",
                param="messages",
            )
        fields = {key: value for key, value in message.items() if value is not None}
        fields["content"] = _message_text(index, role, message.get("content"))
        if role == "assistant" and "tool_calls" in fields:
            tool_calls = _template_tool_calls(index, fields.pop("tool_calls"))
            if tool_calls is not None:
                fields["tool_calls"] = tool_calls
        normalized.append(fields)
    return normalized


class Tokenizer:
    """Text to token ids and back for one model, and its chat template."""

    def __init__(
        self,
        backend: HfTokenizer,
        special_tokens: dict[str, str],
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._special_tokens = special_tokens
        self._eos_token_ids = eos_token_ids
        self._chat_template = (
            None if chat_template is None else compile_chat_template(chat_template)
        )
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        decoder_json = json.dumps(decoder, ensure_ascii=False)
        self._is_byte_level = '"ByteLevel"' in decoder_json
        # Metaspace-style vocabularies mark word starts with "▁", which decode() strips from a
        # lone first token; token_text restores it as vLLM's logprobs do.
        self._has_metaspace = '"Metaspace"' in decoder_json or _METASPACE in decoder_json
        self._byte_level_alphabet = _byte_level_alphabet() if self._is_byte_level else {}
        self._added_token_ids = frozenset(backend.get_added_tokens_decoder())

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Tokenizer:
        """From a Hugging Face model directory, a GGUF file, or a directory holding one."""
        model_dir = Path(model_dir)
        gguf_path = find_gguf(model_dir)
        if gguf_path is not None:
            parts = gguf_tokenizer_parts(open_gguf(gguf_path))
            return cls(
                parts.backend, parts.special_tokens, parts.eos_token_ids, parts.chat_template
            )
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(
                f"{tokenizer_file} not found: the gateway needs a fast (tokenizers) tokenizer"
            )
        # NOTE: BOS/EOS come from tokenizer.json's post-processor alone; transformers 5 does not
        # rebuild it from the config's add_bos_token / add_eos_token either.
        backend = HfTokenizer.from_file(str(tokenizer_file))
        # A prompt is never silently cut or padded: limits are checked on its length instead.
        backend.no_truncation()
        backend.no_padding()

        config = _read_json(model_dir / "tokenizer_config.json")
        # Legacy checkpoints name their special tokens only in special_tokens_map.json.
        legacy_map = _read_json(model_dir / "special_tokens_map.json")
        special_tokens = {}
        for name in _SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(name)) or _token_content(legacy_map.get(name))
            if content is not None:
                special_tokens[name] = content

        eos_ids = []
        eos_token = special_tokens.get("eos_token")
        eos_id = None if eos_token is None else backend.token_to_id(eos_token)
        if eos_id is not None:
            eos_ids.append(eos_id)
        # generation_config.json lists every id that ends a turn (e.g. Llama 3's <|eot_id|>).
        generation_eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        for eos_id in generation_eos or ():
            if isinstance(eos_id, int) and eos_id not in eos_ids:
                eos_ids.append(eos_id)

        return cls(
            backend,
            special_tokens,
            tuple(eos_ids),
            _read_chat_template(model_dir, config),
        )

    @property
    def backend(self) -> HfTokenizer:
        """The ``tokenizers`` object, for streaming decoders."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included; the model's embedding may be larger."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens (``bos_token``, ``eos_token``...) as strings."""
        return dict(self._special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: encode_batch, not encode: only the batch call releases the GIL, so a long prompt
        # (4 MiB: ~6 s) tokenized in a worker thread does not freeze the event loop.
        (encoding,) = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # NOTE: no clean_up_tokenization_spaces: transformers 5 ignores it for BPE vocabularies,
        # which is what LLMs ship.
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as vLLM shows it in logprobs: decoded alone, special tokens kept.

        A byte of a multi-byte character decodes alone to U+FFFD; ``token_bytes`` has its bytes.
        """
        text = self._backend.decode([token_id], skip_special_tokens=False)
        if self._has_metaspace and token_id not in self._added_token_ids:
            # decode() strips the marker of a lone first token; the vocabulary entry keeps it.
            piece = self._backend.id_to_token(token_id) or ""
            num_markers = len(piece) - len(piece.lstrip(_METASPACE))
            num_missing = num_markers - (len(text) - len(text.lstrip(" ")))
            if num_missing > 0:
                text = " " * num_missing + text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for; joined over a sequence they give its UTF-8."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""  # an id past the vocabulary (padded embedding rows) stands for nothing
        if token_id in self._added_token_ids:
            return piece.encode("utf-8")
        if self._is_byte_level:
            return bytes(self._byte_level_alphabet[char] for char in piece)
        if piece.startswith(_BYTE_FALLBACK_PREFIX) and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        return piece.replace(_METASPACE, " ").encode("utf-8")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template, as transformers does.

        ``continue_final_message``: the text ends inside the last message, without what the
        template writes after it (end of turn), so the model continues it; it excludes the
        generation prompt. ``template_kwargs`` reach the template as variables (``tools``,
        ``enable_thinking``...; any name, ``self`` included: the parameters before them are
        positional-only) and override the special tokens of the same name.
        """
        if self._chat_template is None:
            raise invalid(
                "this model has no chat template; use the completions API with a plain prompt",
                param="messages",
            )
        if continue_final_message and add_generation_prompt:
            # vLLM (through transformers) refuses both too; add_generation_prompt defaults to
            # true on the OpenAI bridge.
            raise invalid(
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
            rendered = self._chat_template.render(variables)
        except jinja2.TemplateError as exc:
            # raise_exception() in a template is how models refuse a conversation they cannot
            # take (e.g. roles that do not alternate): the client's request is at fault.
            raise invalid(f"the chat template rejected the messages: {exc}", "messages") from exc
        except Exception as exc:
            # The template is untrusted code run on the client's values (messages, tool call
            # arguments, chat_template_kwargs): "'a' + none" or "3|items" fail it in plain
            # Python. vLLM answers any failure of it with a 400, and so does the gateway.
            raise invalid(
                f"the chat template rejected the messages: {type(exc).__name__}: {exc}",
                "messages",
            ) from exc
        if continue_final_message:
            rendered = _cut_at_continue_tag(rendered, final_text)
        return rendered

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation.

        The template writes its own BOS, so encoding adds no special tokens (vLLM and
        transformers do the same; adding them would double the BOS).
        """
        text = self.apply_chat_template(
            messages, add_generation_prompt, continue_final_message, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)
