"""The model's tokenizer and chat template, loaded without transformers.

The gateway image has no torch or transformers, so this module reads the model itself. A GGUF
file (or a directory holding one) carries vocabulary, special tokens and chat template in its
metadata (``services.gguf_tokenizer`` rebuilds the tokenizer). A Hugging Face model directory
gives ``tokenizer.json`` (read through the ``tokenizers`` library), ``tokenizer_config.json``
for the named special tokens and the chat template (``chat_template.jinja`` wins when present, as
in transformers 5), and ``generation_config.json`` for extra EOS ids. Encoding, decoding and
template rendering match ``transformers.AutoTokenizer`` on the same model; the tests check it.
How a conversation is rendered is ``services.chat_template``'s, and the files are read by
``services.model_tokenizer`` (both shared with the offline ``LLM.chat``); ``--chat-template``
replaces the model's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HfTokenizer

from gateway.errors import invalid, invalid_from
from services.chat_template import ChatRequestError, ChatTemplate, ChatTemplateError
from services.gguf_tokenizer import gguf_tokenizer_parts
from services.model_tokenizer import (
    chat_template_origin,
    read_chat_template,
    read_optional_json,
    read_special_tokens,
)
from services.models import ModelFileError
from services.models.gguf_file import find_gguf, open_gguf

logger = logging.getLogger(__name__)

# Byte fallback tokens of SentencePiece-style vocabularies, e.g. "<0xE2>".
_BYTE_FALLBACK_PREFIX = "<0x"
# The word-boundary marker of SentencePiece-style vocabularies.
_METASPACE = "\u2581"


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
            None if chat_template is None else ChatTemplate(chat_template, special_tokens)
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
    def from_model_dir(cls, model_dir: Path, chat_template: str | None = None) -> Tokenizer:
        """From a Hugging Face model directory, a GGUF file, or a directory holding one.

        ``chat_template``: rendered in place of the model's, which is then not read
        (``--chat-template``); ``ChatTemplateError`` when it does not compile or cannot render
        a one-message conversation. A model's own broken template is a ``ModelFileError``.
        """
        model_dir = Path(model_dir)
        gguf_path = find_gguf(model_dir)
        try:
            if gguf_path is not None:
                parts = gguf_tokenizer_parts(open_gguf(gguf_path))
                template = parts.chat_template if chat_template is None else chat_template
                tokenizer = cls(parts.backend, parts.special_tokens, parts.eos_token_ids, template)
            else:
                tokenizer = cls._from_hf_dir(model_dir, chat_template)
        except ChatTemplateError as exc:
            if chat_template is not None:
                raise  # the flag's: the caller names it
            # The template comes from the checkpoint: name the file to fix.
            origin = gguf_path or chat_template_origin(model_dir)
            raise ModelFileError(origin, str(exc)) from None
        if chat_template is not None:
            assert tokenizer._chat_template is not None
            tokenizer._chat_template.check_renders()
        return tokenizer

    @classmethod
    def _from_hf_dir(cls, model_dir: Path, chat_template: str | None = None) -> Tokenizer:
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

        special_tokens = read_special_tokens(model_dir)

        eos_ids = []
        eos_token = special_tokens.get("eos_token")
        eos_id = None if eos_token is None else backend.token_to_id(eos_token)
        if eos_id is not None:
            eos_ids.append(eos_id)
        # generation_config.json lists every id that ends a turn (e.g. Llama 3's <|eot_id|>).
        generation_eos = read_optional_json(model_dir / "generation_config.json").get(
            "eos_token_id"
        )
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        for eos_id in generation_eos or ():
            if isinstance(eos_id, int) and eos_id not in eos_ids:
                eos_ids.append(eos_id)

        if chat_template is None:
            chat_template = read_chat_template(model_dir)
        return cls(backend, special_tokens, tuple(eos_ids), chat_template)

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

    def encode_text(self, text: str) -> list[int]:
        """``text``'s ids without special tokens (a piece of text, not a prompt)."""
        return self.encode(text, add_special_tokens=False)

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
        """Render ``messages`` with the model's chat template (``ChatTemplate.render``)."""
        if self._chat_template is None:
            raise invalid(
                "this model has no chat template; use the completions API with a plain prompt",
                param="messages",
            )
        try:
            return self._chat_template.render(
                messages, add_generation_prompt, continue_final_message, **template_kwargs
            )
        except ChatRequestError as exc:
            raise invalid_from(exc) from exc.__cause__

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation.

        The template writes its own BOS, so encoding adds no special tokens unless asked (vLLM
        and transformers do the same; adding them would double the BOS).
        """
        text = self.apply_chat_template(
            messages, add_generation_prompt, continue_final_message, **template_kwargs
        )
        return self.encode(text, add_special_tokens=add_special_tokens)
