"""One token's log-probability as the offline ``LLM`` hands it out: vLLM's ``Logprob``.

vLLM scripts read ``out.outputs[0].logprobs[i][token_id].logprob`` (and ``.rank``,
``.decoded_token``); the engine carries plain ``{token id: logprob}`` dicts and the sampled
token's rank beside them, and ``logprob_entries`` makes the offline outputs' entries from those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: a token's raw log-probability (``log_softmax`` of the model's logits,
    before penalties and temperature), its rank in the vocabulary and its text."""

    logprob: float
    rank: int | None = None
    """1 + the number of tokens with a greater logprob. For the top-n tokens asked for, their
    place among them (1 .. n, vLLM's); for a sampled or prompt token outside them, its rank in
    the whole vocabulary."""
    decoded_token: str | None = None
    """The token alone decoded (special tokens as their text); None where the output has no
    text (``detokenize=False``, ``skip_tokenizer_init=True``)."""


DecodeToken = Callable[[int], str]
"""A token id's text on its own."""


def logprob_entries(
    entries: Mapping[int, float],
    token_id: int,
    token_rank: int | None,
    num_top: int,
    decode: DecodeToken | None,
) -> dict[int, Logprob]:
    """One position's ``{id: Logprob}`` from the engine's ``entries`` (``token_id``'s logprob
    plus those of the ``num_top`` most likely tokens, ``token_id`` first). The top-n take ranks
    1 .. n by logprob (ties in the engine's order); ``token_id``, where it is not among them,
    takes ``token_rank``. Ordered as the engine's: ``token_id`` first."""
    # The engine's dict holds num_top + 1 entries exactly when token_id is not in the top-n.
    outside = len(entries) > num_top
    top = [tid for tid in entries if not (outside and tid == token_id)]
    top.sort(key=lambda tid: -entries[tid])  # stable: the engine's order among equal values
    ranks: dict[int, int | None] = {tid: place for place, tid in enumerate(top, start=1)}
    if outside:
        ranks[token_id] = token_rank
    return {
        tid: Logprob(value, ranks[tid], None if decode is None else decode(tid))
        for tid, value in entries.items()
    }
