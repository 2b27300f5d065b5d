"""Stop strings for ``LLM.generate``: an output's text as it is generated, and where it first
contains one of the request's ``SamplingParams.stop`` strings.

Life cycle: one ``TextStops`` per request that has stop strings, made when ``LLM.generate``
queues it; fed each generated token id in order until it reports a match (the caller then
aborts the request in the engine and ends it with ``stop``) or the request finishes otherwise;
``text`` is then the output's text.

The match is the one that ends first in the text (``services.stop_strings``, the rule of the
gateway's streaming ``StopStringMatcher`` too, which also has to hold back text that could begin
a stop string before it sends it). Offline nothing goes out before the request ends, so this
only searches each token's new text together with the few characters before it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers import Tokenizer as HfTokenizer
from tokenizers.decoders import DecodeStream

from services.prompt_context import text_after
from services.stop_strings import first_stop_match

logger = logging.getLogger(__name__)


class TextStops:
    """Feed it a request's generated token ids; it says when the text reaches a stop string."""

    def __init__(
        self,
        tokenizer: HfTokenizer,
        stops: tuple[str, ...],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool = True,
        context: Sequence[int] = (),
    ) -> None:
        """``context``: the prompt tokens the output's text continues (``prompt_context``)."""
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stops = stops
        self._include = include_stop_str_in_output
        self._skip_special_tokens = skip_special_tokens
        # Token ids to text a token at a time, holding back a token that ends in an incomplete
        # character; None once it failed (then the text is decoded whole each time).
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._context = list(context)
        if self._context:
            self._stream.step(tokenizer, self._context)  # primes the stream; text discarded
        self._token_ids: list[int] = []
        self.text = ""
        """The text so far; once ``matched``, cut after the stop string (with
        ``include_stop_str_in_output``) or before it."""
        self.matched: str | None = None
        """The stop string that ended the text, once one did."""

    def feed(self, token_id: int) -> bool:
        """Adds one generated token; True when the text now holds a stop string (and ``text``
        and ``matched`` say where and which). Not to be fed after that."""
        assert self.matched is None, "fed past its stop"
        self._token_ids.append(token_id)
        searched = len(self.text)
        self.text = self._extended()
        match = first_stop_match(self.text, self._stops, searched)
        if match is None:
            return False
        begin, stop = match
        self.text = self.text[: begin + len(stop) if self._include else begin]
        self.matched = stop
        return True

    def _extended(self) -> str:
        if self._stream is not None:
            try:
                piece = self._stream.step(self._tokenizer, self._token_ids[-1])
            except Exception as exc:  # noqa: BLE001 - a decoder's limit, not the request's fault
                # DecodeStream refuses some decoders' non-monotonic output (vLLM issue 17448).
                logger.warning("incremental decoding failed (%s): decoding whole texts", exc)
                self._stream = None
            else:
                return self.text + (piece or "")
        return text_after(self._decode, self._context, self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
