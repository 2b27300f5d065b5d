"""Speculative decoding by n-gram prompt lookup: what to propose, and what of it to keep.

A request that repeats itself (code edited in place, a quoted document, a summary citing its
source, a loop) often continues a run of tokens it already holds. After each step the proposer
looks the request's last ``n`` tokens up earlier in its own tokens (``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``) and proposes the tokens that followed the
latest match. The next step computes the request's last token and the proposals as one chunk
(``ScheduledChunk.draft_token_ids``), a sample at each of its positions, and keeps the proposals
up to the first one that differs from its position's sample, plus that sample
(``num_accepted``): between 1 and ``num_speculative_tokens + 1`` tokens per step.

Why sampling at every position and comparing is exact: a proposal ``d`` is one token, not a
distribution, so speculative sampling's rule (accept with probability ``p(d)``; on rejection,
sample from ``p`` without ``d``) is the same as drawing ``t ~ p`` and keeping ``d`` when ``t ==
d``, else keeping ``t``. Each position's ``p`` is the model's given the kept tokens before it
(penalties, ``min_tokens`` and bad words see the proposals before it as outputs:
``SamplingMetadata`` rows built by ``verify_rows``), so greedy requests produce the tokens they
would without speculation, and random ones tokens of the same distribution (not the same draws).

Life cycle: the engine makes one ``NgramProposer`` when speculation is on; ``propose`` keeps a
packed copy of each running request's tokens between steps (extended, never rebuilt), which
``release`` drops when the request ends, whatever the way. Pure Python: no torch.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

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
    request's outputs and the proposals before ``i`` (``SamplingMetadata.output_token_ids``)."""
    return [output_token_ids + list(drafts[:i]) for i in range(len(drafts) + 1)]


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        # Each request's tokens as int32s, so that a lookup is one bytes.rfind in C rather than
        # a Python loop over thousands of tokens per request and step.
        self._tokens: dict[str, array[int]] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``min(max_tokens, num_speculative_tokens)`` tokens that followed the latest
        earlier occurrence of the longest suffix of ``token_ids`` (at least
        ``prompt_lookup_min`` tokens long); none without one."""
        limit = min(max_tokens, self.config.num_speculative_tokens)
        if limit <= 0:
            return []
        packed = self._tokens.get(request_id)
        if packed is None or len(packed) > len(token_ids):
            packed = self._tokens[request_id] = array("i")
        packed.extend(token_ids[len(packed) :])
        data = packed.tobytes()
        num_tokens = len(packed)
        high = min(self.config.prompt_lookup_max, num_tokens - 1)
        for n in range(high, self.config.prompt_lookup_min - 1, -1):
            start = _latest_match(data, n, num_tokens)
            if start is not None:
                follow = start + n  # the first token after the match
                return list(packed[follow : min(follow + limit, num_tokens)])
        return []

    def release(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._tokens)


def _latest_match(data: bytes, n: int, num_tokens: int) -> int | None:
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
