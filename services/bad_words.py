"""vLLM's ``bad_words``: the words a request forbids (the gateway's APIs and the offline
``SamplingParams.bad_words``), as the token sequences the engine bans
(``SamplingParams.bad_words_token_ids``; the sampler forbids a sequence's last token wherever
the output ends with the tokens before it).

A word is spelled two ways in tokens: at the start of a text, and after a space, where BPE
vocabularies have word-initial tokens of their own (SmolLM2: ``"Paris"`` is 38634, ``" Paris"``
7042). Both spellings are banned, the word's leading whitespace stripped first, as vLLM does
(a word of only whitespace is kept whole: ``"\n"`` bans the newline, not a space).
vLLM skips the spaced spelling when it has another number of tokens than the plain one (its
``update_from_tokenizer``), which leaves such a word free mid-text (SmolLM2: ``"unbelievable"``
is 3 tokens, ``" unbelievable"`` 2); here it is banned too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def bad_words_token_ids(
    encode: Callable[[str], Sequence[int]], words: Sequence[str]
) -> tuple[tuple[int, ...], ...]:
    """Each word's distinct spellings in tokens, in order; ``words`` are non-empty. ``encode``
    tokenizes a text without special tokens (the gateway's tokenizer and the offline ``LLM``'s
    each give theirs)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        stripped = word.lstrip() or word
        for text in (stripped, " " + stripped):
            ids = tuple(encode(text))
            if ids and ids not in sequences:
                sequences.append(ids)
    return tuple(sequences)
