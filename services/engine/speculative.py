"""Speculative decoding by n-gram prompt lookup: what to propose, and what of it to keep.

A request that repeats itself (code edited in place, a quoted document, a summary citing its
source, a loop) often continues a run of tokens it already holds. After each step the proposer
looks the request's last ``n`` tokens up earlier in its own tokens (``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``) and proposes the tokens that followed the
latest match, at most one more than its last proposal kept. The next step computes the
request's last token and the proposals as one chunk (``ScheduledChunk.draft_token_ids``; the
model runner makes each a decode row), a sample at each of its positions, and keeps the
proposals up to the first one that differs from its position's sample, plus that sample
(``num_accepted``): between 1 and ``num_speculative_tokens + 1`` tokens per step.

Why sampling at every position and comparing is exact: a proposal ``d`` is one token, not a
distribution, so speculative sampling's rule (accept with probability ``p(d)``; on rejection,
sample from ``p`` without ``d``) is the same as drawing ``t ~ p`` and keeping ``d`` when ``t ==
d``, else keeping ``t``. Each position's ``p`` is the model's given the kept tokens before it
(penalties, ``min_tokens`` and bad words see the proposals before it as outputs:
``SamplingMetadata`` rows built by ``verify_rows``), so greedy requests produce the tokens they
would without speculation, and random ones tokens of the same distribution (not the same draws).

Life cycle: the engine makes one ``NgramProposer`` when speculation is on; ``propose`` keeps,
per running request, a packed copy of its tokens and their bytes (extended, never rebuilt), its
window and its last proposal (``_Lookup``), which ``release`` drops when the request ends,
whatever the way. Pure Python: no torch.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.engine.config import SpeculativeConfig
from services.types import SamplingParams

_ITEM = array("i").itemsize


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's decode steps may carry proposals: not a constrained one, whose
    grammar would have to take each proposal before its position's mask could be built."""
    return params.guided is None


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Proposals kept: those equal to the token sampled at their position, up to the first that
    is not. ``sampled`` holds one token per position, ``len(drafts) + 1`` of them."""
    assert len(sampled) == len(drafts) + 1, (len(drafts), len(sampled))
    count = 0
    for draft, token in zip(drafts, sampled, strict=False):
        if draft != token:
            break
        count += 1
    return count


def verify_rows(output_token_ids: list[int], drafts: Sequence[int]) -> list[list[int]]:
    """The output tokens each verified position's sample sees: position ``i`` follows the
    request's outputs and the proposals before ``i`` (``SamplingMetadata.output_token_ids``).
    Without proposals, the outputs list itself: a plain decode step copies nothing."""
    if not drafts:
        return [output_token_ids]
    return [output_token_ids + list(drafts[:i]) for i in range(len(drafts) + 1)]


@dataclass(eq=False)
class _Lookup:
    """What the proposer keeps of one request between its steps."""

    tokens: array[int] = field(default_factory=lambda: array("i"))
    """The request's tokens as int32s."""
    data: bytearray = field(default_factory=bytearray)
    """The same int32s' bytes, so that a lookup is one ``rfind`` in C rather than a Python loop
    over thousands of tokens per request and step (extended with ``tokens``: a step copies its
    new tokens, not the whole sequence)."""
    window: int = 0
    """How many tokens the next proposal may hold (``NgramProposer.propose``)."""
    proposed_at: int = 0
    """``len(tokens)`` when ``proposed`` was made."""
    proposed: list[int] = field(default_factory=list)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._lookups: dict[str, _Lookup] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``min(max_tokens, window)`` tokens that followed the latest earlier occurrence
        of the longest suffix of ``token_ids`` (at least ``prompt_lookup_min`` tokens long);
        none without one.

        The window is the request's own: one more than its last proposal kept, at most
        ``num_speculative_tokens`` (where it starts). A request whose text does not repeat its
        prompt then verifies one proposal a step, not ``num_speculative_tokens`` wrong ones,
        each a row of compute; one that copies grows it back a token a step."""
        lookup = self._lookups.get(request_id)
        if lookup is None or len(lookup.tokens) > len(token_ids):
            lookup = self._lookups[request_id] = _Lookup(window=self.config.num_speculative_tokens)
        packed = lookup.tokens
        new = array("i", token_ids[len(packed) :])
        packed.extend(new)
        lookup.data += new.tobytes()
        num_tokens = len(packed)
        if lookup.proposed:
            # The tokens that followed the last proposal: its kept ones come first.
            follow = packed[lookup.proposed_at : lookup.proposed_at + len(lookup.proposed) + 1]
            kept = 0
            while (
                kept < len(lookup.proposed)
                and kept < len(follow)
                and (follow[kept] == lookup.proposed[kept])
            ):
                kept += 1
            lookup.window = min(kept + 1, self.config.num_speculative_tokens)
            lookup.proposed = []
        limit = min(max_tokens, lookup.window)
        if limit <= 0:
            return []
        high = min(self.config.prompt_lookup_max, num_tokens - 1)
        for n in range(high, self.config.prompt_lookup_min - 1, -1):
            start = _latest_match(lookup.data, n, num_tokens)
            if start is not None:
                follow_at = start + n  # the first token after the match
                lookup.proposed = list(packed[follow_at : min(follow_at + limit, num_tokens)])
                lookup.proposed_at = num_tokens
                return list(lookup.proposed)
        return []

    def release(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._lookups)


def _latest_match(data: bytearray, n: int, num_tokens: int) -> int | None:
    """The token index of the latest occurrence of the last ``n`` tokens that ends before the
    last token (so at least one token follows it), or None."""
    pattern = data[(num_tokens - n) * _ITEM :]
    end = (num_tokens - 1) * _ITEM  # the match lies within data[:end]
    while True:
        offset = data.rfind(pattern, 0, end)
        if offset < 0:
            return None
        if offset % _ITEM == 0:
            return offset // _ITEM
        # A match across token boundaries: look again, ending before its last byte.
        end = offset + len(pattern) - 1
