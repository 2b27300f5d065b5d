"""A ``tokenizers`` tokenizer rebuilt from a GGUF file's vocabulary, without torch or transformers.

A GGUF has no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``, with a type
per token), the BPE merges, the special token ids and the name of the pre-tokenizer the merges were
learned with (``tokenizer.ggml.pre``). This module builds the byte-level BPE tokenizer those
describe (``tokenizer.ggml.model == "gpt2"``: GPT-2, SmolLM, Llama 3, Qwen2/3 files), splitting
text as llama.cpp does for that pre-tokenizer. Other tokenizer models (SentencePiece ``llama``
files) are refused by name.

Torch-free, and shared by both sides of the torch line so that they agree on every token id: the
gateway tokenizes and detokenizes with it (``gateway.text.tokenizer``), and the engine hands its
``tokenizer.json`` form to llguidance for guided decoding (``services.engine.structured_output``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HfTokenizer

from services.models.gguf_file import GgufFile

logger = logging.getLogger(__name__)

# llama.cpp's token types (llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

# llama.cpp's split expressions (llama-vocab.cpp) for the pre-tokenizers whose split is not
# GPT-2's own, which ByteLevel(use_regex=True) applies.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre → how text is split before BPE.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _byte_level,
    "gpt-2": _byte_level,
    "gpt2": _byte_level,
    # SmolLM: every digit alone, then GPT-2's split.
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level()]
    ),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}
# Qwen2's own tokenizer.json normalizes to NFC before splitting.
_NFC_PRE_TOKENIZERS = frozenset({"qwen2"})
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


@dataclass(frozen=True)
class GgufTokenizerParts:
    """A GGUF file's tokenizer: what ``gateway.text.tokenizer.Tokenizer`` needs, and
    ``backend.to_str()`` is the ``tokenizer.json`` llguidance takes."""

    backend: HfTokenizer
    special_tokens: dict[str, str]
    """The named special tokens (``bos_token``...) as text, for chat templates."""
    eos_token_ids: tuple[int, ...]
    chat_template: str | None


def gguf_tokenizer_parts(gguf: GgufFile) -> GgufTokenizerParts:
    tokenizer_model = gguf.value("tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        raise ValueError(
            f"GGUF file {gguf.path.name} has tokenizer model {tokenizer_model!r}; pdserve "
            "builds byte-level BPE ('gpt2') tokenizers only"
        )
    pre = gguf.value("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF file {gguf.path.name} has pre-tokenizer {pre!r}; pdserve knows "
            f"{', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    tokens: list[str] = gguf.value("tokenizer.ggml.tokens")
    token_types: list[int] = gguf.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in gguf.value("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = HfTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    if pre in _NFC_PRE_TOKENIZERS:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) are matched whole and are special (skipped on decode);
    # user-defined ones (<think>) are matched whole but are text.
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == _CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == _USER_DEFINED
        ]
    )
    special_tokens = {}
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = gguf.value(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            special_tokens[name] = tokens[token_id]
    bos = special_tokens.get("bos_token")
    if gguf.value("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = vocab[bos]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    backend.no_truncation()
    backend.no_padding()
    eos = gguf.generation_config().get("eos_token_id", [])
    return GgufTokenizerParts(
        backend=backend,
        special_tokens=special_tokens,
        eos_token_ids=tuple(eos),
        chat_template=gguf.value("tokenizer.chat_template"),
    )
