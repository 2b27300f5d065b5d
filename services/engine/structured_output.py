"""Grammar matchers of an engine's constrained requests (``SamplingParams.guided``).

Life cycle of one request's matcher:

1. ``add`` when the request enters the engine (``add_request``, or ``reserve`` on a decode
   node): the grammar is compiled here, so a grammar the engine cannot use is refused with a
   ``ValueError`` before the request holds anything.
2. On a decode node, ``commit`` feeds it the first token, which the prefill node sampled under
   the same grammar: the matcher's state is rebuilt from the tokens so far rather than shipped,
   so a request's constrained output is the same disaggregated, colocated or recomputed.
3. Each step, ``bitmask`` writes the tokens each constrained row may take next; the sampler
   masks the others to -inf (unconstrained rows are not touched, and a batch without a
   constrained row costs one dict lookup per row).
4. ``accept`` advances it over the sampled token; once the grammar is complete (no token but EOS
   could follow) the request stops with ``stop``.
5. ``remove`` when the request finishes or is aborted.

The llguidance tokenizer (token bytes for the whole vocabulary, ~150 ms for 32k tokens) is built
from the model directory's ``tokenizer.json`` on the first constrained request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import llguidance
import torch

from services.guided_decoding import GuidedDecoding

logger = logging.getLogger(__name__)


class StructuredOutputs:
    """The matchers of one engine's constrained requests, by request id."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_file = Path(tokenizer_file)
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    @property
    def num_words(self) -> int:
        """int32 words per row of a bitmask: one bit per token of the model's vocabulary."""
        return (self._vocab_size + 31) // 32

    def add(self, request_id: str, guided: GuidedDecoding) -> None:
        """Compile ``guided`` for ``request_id``; ``ValueError`` naming the field if it cannot."""
        assert request_id not in self._matchers, request_id
        guided.check()
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), guided.to_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"{guided.field_name} is invalid: {matcher.get_error()[:300]}")
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def is_allowed(self, request_id: str, token_id: int) -> bool:
        """Whether the grammar lets ``token_id`` come next (a commit's first token)."""
        return self._matchers[request_id].validate_tokens([token_id]) == 1

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance over a sampled token; True once the grammar is complete."""
        matcher = self._matchers[request_id]
        if not matcher.consume_token(token_id):
            # The sampler only draws allowed tokens; an error here is a bug, and the request
            # stops rather than generating text its grammar no longer describes.
            logger.error("request %s: %s", request_id, matcher.get_error()[:300])
            return True
        return matcher.is_stopped()

    def bitmask(self, request_ids: Sequence[str]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens of the constrained rows among ``request_ids`` (one per row), or
        None when no row is constrained.

        Returns ``(bitmask, rows)``: ``bitmask: [len(rows), num_words]`` int32 on the CPU, bit
        ``j`` of word ``w`` allows token ``32 * w + j``; ``rows``: their row indices."""
        if not self._matchers:
            return None
        rows = [row for row, request_id in enumerate(request_ids) if request_id in self._matchers]
        if not rows:
            return None
        bitmask = torch.empty(len(rows), self.num_words, dtype=torch.int32)
        num_bytes = self.num_words * 4
        for index, row in enumerate(rows):
            matcher = self._matchers[request_ids[row]]
            # Writes the row in place and releases the GIL while it computes.
            matcher.unsafe_compute_mask_ptr(bitmask[index].data_ptr(), num_bytes)
        return bitmask, rows

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if not self._tokenizer_file.is_file():
                raise ValueError(
                    f"guided decoding needs the model's tokenizer.json ({self._tokenizer_file} "
                    "not found)"
                )
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_file.read_text(encoding="utf-8"),
                n_vocab=self._vocab_size,
                eos_token=self._eos_token_ids or None,
            )
        return self._tokenizer
