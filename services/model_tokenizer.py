"""The model's tokenizer as the ``tokenizers`` library reads it, for the engine's own uses, and
its chat template with the special tokens every render gets.

A Hugging Face directory holds it as ``tokenizer.json``; a GGUF checkpoint has none, and
``services.gguf_tokenizer`` builds the same object from its metadata. The gateway encodes prompts
with this very tokenizer (``gateway.text.tokenizer``), so that guided decoding's grammar
(``services.engine.structured_output``) and the offline ``LLM``'s text prompts and outputs use the
model's token ids; both render chats with the template read here (``tokenizer_config.json``'s, or
``chat_template.jinja``, which wins as in transformers 5; a GGUF file's metadata). Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HfTokenizer

from services.gguf_tokenizer import gguf_tokenizer_parts
from services.models.gguf_file import find_gguf, open_gguf
from services.models.model_file_error import read_json_object

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


def tokenizer_json(model_path: Path, purpose: str) -> str:
    """The ``tokenizer.json`` text of the model at ``model_path``; ``ValueError`` saying what is
    missing, and that ``purpose`` needs it, when it has no tokenizer pdserve can read."""
    gguf_path = find_gguf(model_path)
    if gguf_path is not None:
        try:
            parts = gguf_tokenizer_parts(open_gguf(gguf_path))
        except ValueError as exc:
            raise ValueError(f"{purpose} needs the model's tokenizer: {exc}") from None
        return parts.backend.to_str()
    tokenizer_file = Path(model_path) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(
            f"{purpose} needs the model's tokenizer ({tokenizer_file} not found, and "
            f"{model_path} is not a GGUF checkpoint)"
        )
    return tokenizer_file.read_text(encoding="utf-8")


def load_tokenizer(model_path: Path, purpose: str) -> HfTokenizer:
    """The model's tokenizer (``tokenizer_json``), which never cuts or pads: a prompt's length
    is checked against the limits instead."""
    backend = HfTokenizer.from_str(tokenizer_json(model_path, purpose))
    backend.no_truncation()
    backend.no_padding()
    return backend


def read_optional_json(path: Path) -> dict[str, Any]:
    """The file's JSON object, or {} when the model has no such file (each is optional)."""
    return read_json_object(path) if path.is_file() else {}


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = value.get("content")
        if isinstance(content, str):
            return content
    return None


def read_special_tokens(model_dir: Path) -> dict[str, str]:
    """The named special tokens of a Hugging Face model directory (``bos_token``...), as
    ``tokenizer_config.json`` gives them (legacy checkpoints: ``special_tokens_map.json``)."""
    config = read_optional_json(model_dir / "tokenizer_config.json")
    legacy_map = read_optional_json(model_dir / "special_tokens_map.json")
    special_tokens = {}
    for name in _SPECIAL_TOKEN_NAMES:
        content = _token_content(config.get(name)) or _token_content(legacy_map.get(name))
        if content is not None:
            special_tokens[name] = content
    return special_tokens


def chat_template_origin(model_dir: Path) -> Path:
    """The file ``read_chat_template`` reads the template from."""
    template_file = model_dir / "chat_template.jinja"
    return template_file if template_file.is_file() else model_dir / "tokenizer_config.json"


def read_chat_template(model_dir: Path) -> str | None:
    """The chat template of a Hugging Face model directory, or None where it has none."""
    # transformers 5 loads chat_template.jinja over the config's key; newer checkpoints ship it.
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = read_optional_json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        # Several named templates: serving uses the default one, as transformers does.
        named = {item.get("name"): item.get("template") for item in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def chat_template_parts(model_path: Path) -> tuple[str | None, dict[str, str], Path]:
    """(chat template or None, named special tokens, the file they come from) of the model at
    ``model_path``: a GGUF file's metadata, or a Hugging Face directory's files."""
    gguf_path = find_gguf(model_path)
    if gguf_path is not None:
        parts = gguf_tokenizer_parts(open_gguf(gguf_path))
        return parts.chat_template, dict(parts.special_tokens), gguf_path
    return (
        read_chat_template(model_path),
        read_special_tokens(model_path),
        chat_template_origin(model_path),
    )
