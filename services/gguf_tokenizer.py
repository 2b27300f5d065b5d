"""A ``tokenizers`` tokenizer rebuilt from a GGUF file's vocabulary, without torch or transformers.

A GGUF has no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``, with a type
per token), the special token ids, and what the tokenizer model needs besides. This module builds
the two kinds the ``tokenizer.ggml.model`` key names for the architectures pdserve runs:

- ``gpt2``, byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen2/3 files): the file's merges, and text
  split as llama.cpp does for the pre-tokenizer the merges were learned with
  (``tokenizer.ggml.pre``).
- ``llama``, SentencePiece BPE (Llama 2, TinyLlama, Mistral 7B v0.1/v0.2, Vicuna files): "▁" for
  spaces and before the text (``tokenizer.ggml.add_space_prefix``), byte fallback to the
  ``<0xNN>`` tokens, merges from the file or else derived from the vocabulary and
  ``tokenizer.ggml.scores``, and BOS (``add_bos_token``, on unless the file says otherwise) and
  EOS (``add_eos_token``) around an encoding with special tokens. It gives the ids of
  transformers' own GGUF tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) on
  the same file, which the tests check on synthetic vocabularies; where that differs from
  llama.cpp, see ``_sentencepiece_bpe``. A file with neither merges nor scores is refused.

Other tokenizer models (``t5``, ``gemma4``, ...) are refused by name.

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

# llama.cpp's token types (llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined,
# 5 unused, 6 byte (<0xNN>).
_NORMAL = 1
_CONTROL = 3
_USER_DEFINED = 4
# SentencePiece's word-boundary mark, which stands for a space.
_METASPACE = "\u2581"

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
    if tokenizer_model not in _TOKENIZER_MODELS:
        raise ValueError(
            f"GGUF file {gguf.path.name} has tokenizer model {tokenizer_model!r}; pdserve "
            "builds byte-level BPE ('gpt2') and SentencePiece ('llama') tokenizers only"
        )
    tokens: list[str] = gguf.value("tokenizer.ggml.tokens")
    token_types: list[int] = gguf.value("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(
            f"GGUF file {gguf.path.name} has {len(tokens)} tokens but {len(token_types)} "
            "token types"
        )
    special_tokens = {}
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = gguf.value(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            special_tokens[name] = tokens[token_id]
    backend = _TOKENIZER_MODELS[tokenizer_model](gguf, tokens, token_types, special_tokens)
    backend.no_truncation()
    backend.no_padding()
    eos = gguf.generation_config().get("eos_token_id", [])
    return GgufTokenizerParts(
        backend=backend,
        special_tokens=special_tokens,
        eos_token_ids=tuple(eos),
        chat_template=gguf.value("tokenizer.chat_template"),
    )


def _byte_level_bpe(
    gguf: GgufFile, tokens: list[str], token_types: list[int], special_tokens: dict[str, str]
) -> HfTokenizer:
    pre = gguf.value("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF file {gguf.path.name} has pre-tokenizer {pre!r}; pdserve knows "
            f"{', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = HfTokenizer(models.BPE(vocab=vocab, merges=_file_merges(gguf), fuse_unk=False))
    if pre in _NFC_PRE_TOKENIZERS:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) are matched whole and are special (skipped on decode);
    # user-defined ones (<think>) are matched whole but are text.
    _add_whole_tokens(backend, tokens, token_types, named_special=())
    bos = special_tokens.get("bos_token")
    if gguf.value("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = vocab[bos]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return backend


def _sentencepiece_bpe(
    gguf: GgufFile, tokens: list[str], token_types: list[int], special_tokens: dict[str, str]
) -> HfTokenizer:
    """SentencePiece's BPE as transformers' GGUF loader rebuilds it (transformers 5:
    ``integrations/gguf/gguf_tokenizer_mapping.py`` and ``LlamaTokenizer``).

    Where transformers and llama.cpp part, this follows transformers, whose ids the tests check:
    - "▁" goes before the start of the text only (Metaspace's ``first``); llama.cpp puts a space
      before every stretch of text that follows a special token ("<s>hi" is "<s>", "hi" here,
      "<s>", "▁hi" in llama.cpp).
    - Text that already starts with a space gets no second "▁" (" hi" is "▁hi" here, "▁▁hi" in
      llama.cpp).
    - Merges are ranked once by the merged token's score (``_merges_from_scores``), where
      llama.cpp merges the adjacent pair whose merged token scores best, the leftmost on a tie;
      the two can cut a word differently where merged tokens tie on score.
    Two choices are transformers 4's (``GGUFLlamaConverter``) rather than 5's, and agree with
    llama.cpp: ``add_space_prefix`` false prepends nothing and strips nothing on decode
    (transformers 5 ignores the key), and a character without a byte token becomes the unknown
    token (transformers 5 sets no unknown token and drops the character). Neither shows in a
    file that leaves the key unset (or true) and has all 256 byte tokens.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _file_merges(gguf) or _merges_from_scores(gguf, tokens)
    unk = special_tokens.get("unk_token")
    backend = HfTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_space_prefix = bool(gguf.value("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_METASPACE, prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace(_METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    # transformers also makes the named tokens (BOS, EOS, unknown, padding) special, whatever
    # their type: "<unk>" in a prompt is the unknown token's id, and decoding skips it.
    _add_whole_tokens(backend, tokens, token_types, named_special=tuple(special_tokens.values()))
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says not to.
    add_bos = gguf.value("tokenizer.ggml.add_bos_token", True)
    add_eos = gguf.value("tokenizer.ggml.add_eos_token", False)
    backend.post_processor = _bos_eos_template(
        special_tokens.get("bos_token") if add_bos else None,
        special_tokens.get("eos_token") if add_eos else None,
        vocab,
    )
    return backend


def _file_merges(gguf: GgufFile) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` ("left right" each, best first), or [] where it has none."""
    merges: list[str] = gguf.value("tokenizer.ggml.merges", [])
    return [_split_merge(merge) for merge in merges]


def _split_merge(merge: str) -> tuple[str, str]:
    left, right = merge.split(" ", 1)
    return left, right


def _merges_from_scores(gguf: GgufFile, tokens: list[str]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every way of cutting a token into two
    tokens of the vocabulary, best first.

    Ranked as transformers ranks them (``generate_merges``), which the ids depend on: higher
    score of the merged token first; on a tie, the longer left piece, then the longer right one;
    then the order of the tokens in the file.
    """
    scores: list[float] | None = gguf.value("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        found = "none" if scores is None else f"{len(scores)}"
        raise ValueError(
            f"GGUF file {gguf.path.name} has tokenizer model 'llama' with {len(tokens)} tokens, "
            f"no merges and {found} tokenizer.ggml.scores: the merges come from one score per "
            "token"
        )
    in_vocab = set(tokens)
    # A token listed twice is ranked at its first place with its last score, as a dict keeps.
    score_of = dict(zip(tokens, scores, strict=True))
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in score_of.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in in_vocab and right in in_vocab:
                ranked.append((score, len(left), len(right), left, right))
    # NOTE: stable, and reverse keeps it so: equal keys stay in file order.
    ranked.sort(key=lambda merge: merge[:3], reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def _add_whole_tokens(
    backend: HfTokenizer,
    tokens: list[str],
    token_types: list[int],
    named_special: tuple[str, ...],
) -> None:
    """Make control tokens (and ``named_special``) special added tokens and user-defined ones
    plain added tokens: both are matched whole in text, before the model splits it, but only
    special ones are skipped on decode."""
    special = [token for token, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL]
    special += [token for token in named_special if token not in special]
    backend.add_special_tokens(
        [AddedToken(token, normalized=False, special=True) for token in special]
    )
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == _USER_DEFINED and token not in special
        ]
    )


def _bos_eos_template(
    bos: str | None, eos: str | None, vocab: dict[str, int]
) -> processors.TemplateProcessing:
    """BOS before and EOS after each sequence (either may be None), as transformers'
    ``update_post_processor`` writes them."""
    single = [f"{bos}:0"] if bos is not None else []
    single += ["$A:0"] + ([f"{eos}:0"] if eos is not None else [])
    pair = single + ([f"{bos}:1"] if bos is not None else [])
    pair += ["$B:1"] + ([f"{eos}:1"] if eos is not None else [])
    named = [token for token in (bos, eos) if token is not None]
    return processors.TemplateProcessing(
        single=" ".join(single),
        pair=" ".join(pair),
        special_tokens=[(token, vocab[token]) for token in dict.fromkeys(named)],
    )


# tokenizer.ggml.model → the builder of its tokenizer.
_TOKENIZER_MODELS: dict[
    str, Callable[[GgufFile, list[str], list[int], dict[str, str]], HfTokenizer]
] = {
    "gpt2": _byte_level_bpe,
    "llama": _sentencepiece_bpe,
}
