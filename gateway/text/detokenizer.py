"""Token ids to text, one chunk at a time, never emitting a broken character.

Byte-level BPE splits rare characters across tokens (an emoji may take four), and
SentencePiece-style vocabularies fall back to byte tokens, so one token's text is not always
text. ``tokenizers.decoders.DecodeStream`` holds tokens back while their decoded text ends in
U+FFFD (an incomplete character) and keeps a few tokens of context so that leading spaces and
merges come out as a full decode would give them (vLLM's prefix_offset / read_offset scheme).

A token's life here:

1. ``add`` feeds it to the stream. Its text is returned at once, or it is *held* while the text
   so far ends in an incomplete character.
2. The token that completes the character releases the text of every held token.
3. ``flush`` at the end of the stream releases what is still held; a character that never
   completed comes out as U+FFFD, as a full decode gives it.

Emitted text is the continuation of the prompt's text: for byte-level vocabularies it equals
``tokenizer.decode(output_ids)``; for SentencePiece ones the first token's word-start space is
kept (as vLLM does), where decoding the output alone would drop it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from gateway.text.tokenizer import Tokenizer
from services.prompt_context import prompt_context, text_after

logger = logging.getLogger(__name__)

# Tokens kept to re-decode held tokens at flush; a character spans at most 4 byte tokens.
_NUM_FLUSH_CONTEXT = 8
# DecodeStream raises this when a decoder's output is not monotonic (vLLM issue 17448).
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """The text of one request's output tokens, as they arrive."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Prompt tokens that prime the stream (a suffix that decodes cleanly).
        context = prompt_context(self._decode, prompt_token_ids)
        if context:
            self._stream.step(tokenizer.backend, context)  # primes the stream; text discarded
        # context_ids: the last tokens whose text was emitted; held_ids: fed, text not yet out.
        self._context_ids = context[-_NUM_FLUSH_CONTEXT:]
        self._held_ids: list[int] = []
        self._is_flushed = False

    @property
    def num_held_tokens(self) -> int:
        """Tokens fed whose text waits for the rest of a character."""
        return len(self._held_ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """The text that ``token_ids`` complete; empty while a character is still partial."""
        assert not self._is_flushed, "add() after flush(): the stream would repeat held text"
        pieces = []
        for token_id in token_ids:
            text = self._step(token_id)
            self._held_ids.append(token_id)
            if text is not None:
                pieces.append(text)
                self._context_ids = [*self._context_ids, *self._held_ids][-_NUM_FLUSH_CONTEXT:]
                self._held_ids = []
        return "".join(pieces)

    def flush(self) -> str:
        """The text of the tokens still held, at the end of the stream."""
        self._is_flushed = True
        if not self._held_ids:
            return ""
        held_ids, self._held_ids = self._held_ids, []
        text = text_after(self._decode, self._context_ids, held_ids)
        self._context_ids = [*self._context_ids, *held_ids][-_NUM_FLUSH_CONTEXT:]
        return text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, self._skip_special_tokens)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer.backend, token_id)
        except Exception as exc:
            if _INVALID_PREFIX_ERROR not in str(exc):
                raise
            # The stream's state is broken; restart it from the held tokens so their text is not
            # lost. Without context a leading space may be lost, as in vLLM's recovery.
            logger.warning(
                "detokenizer restarted after a non-monotonic decode at token %d", token_id
            )
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._tokenizer.backend, [*self._held_ids, token_id])
