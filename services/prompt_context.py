"""The prompt tokens an output's text is decoded after, so that it reads as the prompt's
continuation (vLLM's prefix_offset / read_offset scheme): a SentencePiece vocabulary's decoder
strips the first space of a text, so the first output token's word-start space survives only when
the output is decoded after some of the prompt. Byte-level vocabularies decode the same either way.

Shared by the gateway's streaming detokenizer (``gateway.text.detokenizer``) and the offline
``LLM``'s text (``services.engine``), so that both give one output the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MIN_PROMPT_CONTEXT = 4
MAX_PROMPT_CONTEXT = 24
"""Prompt tokens to decode before the output: enough for a word's merges and leading space
(vLLM's 4 .. 24)."""
REPLACEMENT_CHAR = "\ufffd"

Decode = Callable[[list[int]], str]
"""Token ids to text, with the caller's ``skip_special_tokens``."""


def prompt_context(decode: Decode, prompt_token_ids: Sequence[int]) -> list[int]:
    """The shortest suffix of the prompt, of ``MIN_PROMPT_CONTEXT`` to ``MAX_PROMPT_CONTEXT``
    tokens, whose text has no U+FFFD: one that starts mid-character would put a U+FFFD before
    the output that no later token can take back. [] if there is none."""
    for num_tokens in range(MIN_PROMPT_CONTEXT, MAX_PROMPT_CONTEXT + 1):
        suffix = list(prompt_token_ids[-num_tokens:])
        if REPLACEMENT_CHAR not in decode(suffix):
            return suffix
        if num_tokens >= len(prompt_token_ids):
            break
    return []


def text_after(decode: Decode, context: Sequence[int], token_ids: Sequence[int]) -> str:
    """``token_ids``' text as the continuation of ``context``'s; their text alone where the
    context's is not a prefix of both together (a decoder that is not monotonic)."""
    before = decode(list(context))
    after = decode([*context, *token_ids])
    if after.startswith(before):
        return after[len(before) :]
    return decode(list(token_ids))
