"""Batched sampler: turns one step's logits into one next token per row (vLLM v1 semantics).

What happens to the logits of a step, ``[num_rows, vocab_size]``:

1. Raw logprobs: ``log_softmax`` of the unprocessed float32 logits, for rows that asked for them.
2. ``min_tokens``: EOS and the row's stop ids go to -inf while the row is short of ``min_tokens``.
3. ``allowed_token_ids``: every other token of the row goes to -inf; ``bad_words_token_ids``:
   the last token of each sequence whose other tokens end the row's output goes to -inf; then
   ``logit_bias``: each row's biases are added to their tokens' logits.
4. Penalties: repetition (prompt and output tokens), then frequency and presence (output only).
5. Grammar: constrained rows (``params.guided``) set the tokens their grammar forbids to -inf.
6. Greedy rows take the argmax of what steps 2-5 left.
7. Random rows: temperature, top-k, top-p, min-p, then one uniform draw per row against the
   row's cumulative distribution, from the row's own generator when its request has a seed, so
   its tokens do not depend on the other rows, and from the engine's shared generator (seeded
   by ``EngineConfig.seed``) when it has none.

Each step is skipped when no row of the batch needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.models.layer_ops import LayerOps
from services.types import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingMetadata:
    """What the sampler needs about each row of the logits; the model runner builds it each step."""

    params: list[SamplingParams]
    """One per row."""
    prompt_token_ids: list[list[int]]
    """Per row; the repetition penalty covers prompt and output tokens."""
    output_token_ids: list[list[int]]
    """Per row: tokens generated so far (penalties, ``min_tokens``)."""
    generators: list[torch.Generator | None]
    """Per row: a generator seeded from the request's seed (on the logits' device, where the
    draws are made), None for requests without one."""
    grammar_bitmask: torch.Tensor | None = None
    """``[len(grammar_rows), ceil(vocab_size / 32)]`` int32: bit ``j`` of word ``w`` allows token
    ``32 * w + j`` (llguidance's layout); None when no row is constrained."""
    grammar_rows: tuple[int, ...] = ()
    """The rows ``grammar_bitmask`` constrains, in its order."""
    shared_generator: torch.Generator | None = None
    """What the rows without a generator of their own draw from, on the logits' device (the
    model runner's, seeded by ``EngineConfig.seed``); None: torch's global generator."""

    @property
    def num_rows(self) -> int:
        return len(self.params)


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    """One sampled token per row."""
    logprobs: list[dict[int, float] | None]
    """Per row: None unless ``params.logprobs`` is set; else the raw log-probability of the sampled
    token and of the ``params.logprobs`` most likely tokens."""
    ranks: list[int | None]
    """Per row: None unless ``params.logprobs`` is set; else the sampled token's rank in the
    vocabulary by raw logprob (1 + the tokens with a greater one: vLLM's)."""


GreedyArgmax = Callable[[torch.Tensor], torch.Tensor]
"""[num_rows, vocab] logits → [num_rows] int64: the first index of each row's maximum, NaN
counting as the maximum (``LayerOps.greedy_argmax``)."""


class Sampler:
    def __init__(
        self, eos_token_ids: Sequence[int], greedy_argmax: GreedyArgmax | None = None
    ) -> None:
        """``greedy_argmax``: the model's layer ops' (the native kernel on the CPU); torch's
        ``max(dim)`` by default."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.greedy_argmax = greedy_argmax or LayerOps().greedy_argmax

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SampleResult:
        """Sample one token per row of ``logits: [num_rows, vocab_size]`` (any float dtype)."""
        _check_shapes(logits, metadata)
        params = metadata.params
        num_rows = metadata.num_rows

        # Raw logprobs (vLLM v1's default): before penalties, temperature and truncation.
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            # raw_logprobs: [len(logprob_rows), vocab_size]
            raw_logprobs = torch.log_softmax(logits[logprob_rows].float(), dim=-1)

        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows and not _changes_logits(metadata):
            # Every row greedy and nothing to apply: the argmax of the raw logits is that of
            # their float32 copy (widening is exact), without the copy: 0.42 ms for 64 x 32,000
            # bf16 logits on the 2-core CPU host, 9.6 ms for Qwen's 151,936-token vocabulary.
            token_ids = self.greedy_argmax(logits)
        else:
            processed = process_logits(logits, metadata, self.eos_token_ids)
            token_ids = self._choose(processed, metadata, random_rows)

        logprobs: list[dict[int, float] | None] = [None] * num_rows
        ranks: list[int | None] = [None] * num_rows
        if raw_logprobs is not None:
            row_logprobs, row_ranks = collect_logprobs(
                raw_logprobs,
                token_ids[logprob_rows],
                [params[i].logprobs or 0 for i in logprob_rows],
            )
            for i, row, rank in zip(logprob_rows, row_logprobs, row_ranks, strict=True):
                logprobs[i] = row
                ranks[i] = rank
        return SampleResult(token_ids=token_ids.tolist(), logprobs=logprobs, ranks=ranks)

    def _choose(
        self, processed: torch.Tensor, metadata: SamplingMetadata, random_rows: list[int]
    ) -> torch.Tensor:
        """[num_rows] token ids from the processed logits: the argmax of greedy rows, a draw for
        the ``random_rows``."""
        params = metadata.params
        shared = metadata.shared_generator
        if len(random_rows) == len(params):
            return _sample_random(processed, params, metadata.generators, shared)
        token_ids = self.greedy_argmax(processed)  # [num_rows]
        if random_rows:
            token_ids[random_rows] = _sample_random(
                processed[random_rows],
                [params[i] for i in random_rows],
                [metadata.generators[i] for i in random_rows],
                shared,
            )
        return token_ids


def _changes_logits(metadata: SamplingMetadata) -> bool:
    """Whether ``process_logits`` would change any row of this batch."""
    return any(step.applies(metadata) for step in _LOGITS_STEPS)


def process_logits(
    logits: torch.Tensor, metadata: SamplingMetadata, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """The logits every row's choice is made from: a float32 copy of ``logits: [num_rows,
    vocab_size]`` with ``min_tokens`` masking, logit biases, the penalties and the grammar masks
    applied (greedy rows take its argmax; random rows go on to temperature and truncation)."""
    logits = logits.to(torch.float32, copy=True)
    for step in _LOGITS_STEPS:
        if step.applies(metadata):
            logits = step.apply(logits, metadata, eos_token_ids)
    return logits


@dataclass(frozen=True)
class _LogitsStep:
    """One change ``process_logits`` makes, with the condition it acts on: where no step applies
    the sampler skips the float32 copy, so a step cannot be added without saying when it acts."""

    applies: Callable[[SamplingMetadata], bool]
    """Whether it changes any row of the batch."""
    apply: Callable[[torch.Tensor, SamplingMetadata, Sequence[int]], torch.Tensor]
    """(float32 logits, metadata, eos_token_ids) -> the logits, changed in place or anew."""


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: -inf for the tokens ``bitmask: [len(rows), num_words]`` int32 forbids in
    ``rows`` of ``logits: [num_rows, vocab_size]``; other rows are left as they are.

    Each byte of the mask indexes a table of 8 additive values (0 or -inf), so unpacking is one
    gather and applying one add: 3 ms for 64 x 32,000 on 2 CPU cores, where shifting out each
    bit and a boolean ``masked_fill_`` took 25 ms (best of 200 each, one-off comparison on the
    shared host; the sampler's cost with and without masks is in docs/benchmarks.md)."""
    vocab_size = logits.shape[1]
    device = logits.device
    # Little-endian words: byte b of word w holds tokens 32 * w + 8 * b + (0..7), bit k = token k.
    mask_bytes = bitmask.contiguous().view(torch.uint8).to(device, non_blocking=True)
    table = _bit_table(device)  # [256, 8]
    # additive: [len(rows), num_words * 32] -> [len(rows), vocab_size], 0 or -inf
    additive = table[mask_bytes.long()].flatten(1)[:, :vocab_size]
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        logits.add_(additive)
    else:
        index = torch.tensor(list(rows), dtype=torch.long, device=device)
        logits.index_add_(0, index, additive)


_BIT_TABLES: dict[torch.device, torch.Tensor] = {}


def _bit_table(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` float32: entry ``[b, k]`` is 0 if bit k of byte b is set, else -inf."""
    table = _BIT_TABLES.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
        _BIT_TABLES[device] = table
    return table


def _keep_allowed_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """In place: -inf for every token outside the row's ``params.allowed_token_ids``, in three
    ops for the whole batch (a gather, a fill of the limited rows, a scatter back) rather than
    a few per row."""
    limited: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(metadata.params):
        if p.allowed_token_ids:
            limited.append(i)
            rows.extend([i] * len(p.allowed_token_ids))
            cols.extend(p.allowed_token_ids)
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    kept = logits[index]  # [sum of the rows' allowed counts]
    logits.index_fill_(0, torch.tensor(limited, device=device), float("-inf"))
    logits[index] = kept
    return logits


def _ban_bad_words(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """In place: -inf for each token that would complete one of the row's bad words, i.e. the
    last token of every ``params.bad_words_token_ids`` sequence whose other tokens end the row's
    output (vLLM's ``bad_words``: the prompt does not count, so a word can begin the output)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, output) in enumerate(zip(metadata.params, metadata.output_token_ids, strict=True)):
        if not p.bad_words_token_ids:
            continue
        singles, longer = p.bad_word_endings
        rows.extend([i] * len(singles))
        cols.extend(singles)
        # Only the sequences whose next-to-last token is the output's last can be completing.
        for word in longer.get(output[-1], ()) if output else ():
            prefix = len(word) - 1
            if prefix <= len(output) and tuple(output[-prefix:]) == word[:-1]:
                rows.append(i)
                cols.append(word[-1])
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=device))
    return logits


def _add_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """In place: each row's ``params.logit_bias`` added to its tokens' logits."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(metadata.params):
        for token_id, bias in p.logit_bias:
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    if rows:
        device = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
            torch.tensor(values, dtype=torch.float32, device=device),
            accumulate=True,
        )
    return logits


def _check_shapes(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab_size], got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    for name in ("params", "prompt_token_ids", "output_token_ids", "generators"):
        if len(getattr(metadata, name)) != num_rows:
            raise ValueError(
                f"metadata.{name} has {len(getattr(metadata, name))} rows, logits have {num_rows}"
            )
    if metadata.grammar_bitmask is not None:
        if metadata.grammar_bitmask.shape[0] != len(metadata.grammar_rows):
            raise ValueError("metadata.grammar_bitmask and grammar_rows differ in rows")
        if metadata.grammar_bitmask.shape[1] * 32 < logits.shape[1]:
            raise ValueError(
                f"metadata.grammar_bitmask covers {metadata.grammar_bitmask.shape[1] * 32} "
                f"tokens, logits have {logits.shape[1]}"
            )


def _mask_stop_tokens(
    logits: torch.Tensor, metadata: SamplingMetadata, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """In place: EOS and stop ids to -inf in rows that have not reached ``min_tokens`` yet."""
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, output) in enumerate(zip(metadata.params, metadata.output_token_ids, strict=True)):
        if len(output) < p.min_tokens:
            # NOTE: EOS is masked even with ignore_eos, which only decides whether EOS stops.
            stop_ids = (*eos_token_ids, *p.stop_token_ids)
            rows.extend([i] * len(stop_ids))
            cols.extend(stop_ids)
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.long, device=logits.device)
        logits[index[0], index[1]] = float("-inf")
    return logits


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens, then frequency and presence penalties over
    output tokens; rows without penalties get neutral values (1, 0, 0)."""
    params = metadata.params
    if not any(p.has_penalties for p in params):
        return logits
    vocab_size = logits.shape[1]
    device = logits.device
    # output_counts: [num_rows, vocab_size], occurrences of each token in the row's output
    output_counts = _count_tokens(metadata.output_token_ids, vocab_size, device)

    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _count_tokens(metadata.prompt_token_ids, vocab_size, device)
        seen = (prompt_counts > 0) | (output_counts > 0)  # [num_rows, vocab_size]
        penalty = _row_tensor([p.repetition_penalty for p in params], device)  # [num_rows, 1]
        # Dividing a positive logit and multiplying a negative one both make the token less likely.
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)

    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        frequency = _row_tensor([p.frequency_penalty for p in params], device)  # [num_rows, 1]
        presence = _row_tensor([p.presence_penalty for p in params], device)  # [num_rows, 1]
        logits = logits - frequency * output_counts - presence * (output_counts > 0).float()
    return logits


def _count_tokens(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[num_rows, vocab_size]`` float32 count of each token id in each row's list."""
    num_rows = len(token_ids)
    max_len = max((len(ids) for ids in token_ids), default=0)
    if max_len == 0:
        return torch.zeros(num_rows, vocab_size, device=device)
    # Padding points at an extra column vocab_size, dropped after the scatter.
    padded = torch.tensor(
        [ids + [vocab_size] * (max_len - len(ids)) for ids in token_ids],
        dtype=torch.long,
        device=device,
    )  # [num_rows, max_len]
    counts = torch.zeros(num_rows, vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    """A per-row parameter as a ``[num_rows, 1]`` float32 column, to broadcast over the vocab."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _sample_random(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample ``[num_rows]`` token ids from ``logits: [num_rows, vocab_size]`` (modified in place),
    all of whose rows are non-greedy; rows without a generator draw from ``shared_generator``."""
    vocab_size = logits.shape[1]
    device = logits.device
    if any(p.temperature != 1.0 for p in params):
        logits.div_(_row_tensor([p.temperature for p in params], device))

    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    use_top_k = any(k < vocab_size for k in top_k)
    use_top_p = any(p < 1.0 for p in top_p)
    if use_top_k or use_top_p:
        logits = _apply_top_k_top_p(
            logits,
            torch.tensor(top_k, dtype=torch.long, device=device) if use_top_k else None,
            torch.tensor(top_p, dtype=torch.float32, device=device) if use_top_p else None,
        )

    if any(p.min_p > 0.0 for p in params):
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p): no softmax needed, and
        # log(0) = -inf leaves rows with min_p = 0 untouched.
        min_p = _row_tensor([p.min_p for p in params], device)
        threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)
        logits.masked_fill_(logits < threshold, float("-inf"))

    probs = logits.softmax(dim=-1)  # [num_rows, vocab_size]
    return _inverse_cdf(probs, generators, shared_generator)


_MIN_CANDIDATES = 256
"""Top-k / top-p first take each row's ``_MIN_CANDIDATES`` (or its largest top-k) most likely
tokens with ``topk``: 4 ms for 64 x 32,000 on 2 CPU cores, where sorting the rows takes 70-150 ms.
A trained model's nucleus fits in them; flat rows (random weights) are sorted in full."""
_MAX_CANDIDATES = 4096
"""Rows with a larger top-k are sorted in full: ``topk`` of more costs nearly as much as a sort."""
_TOP_P_MARGIN = 1e-5
"""Rows whose mass above a token lies this close to top_p are sorted in full, so that the float32
rounding of the sorted path (< 1e-6 for 32,000 tokens) decides their cut as it always did."""


def _apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    *,
    min_candidates: int = _MIN_CANDIDATES,
) -> torch.Tensor:
    """Mask to -inf what top-k (``[num_rows]``, vocab_size = off) and then top-p (``[num_rows]``,
    1 = off) drop. The most likely token of each row always survives.

    A row whose kept set provably lies in its ``num_candidates`` largest logits is masked from a
    ``topk``; the others are sorted in full (``_top_k_top_p_by_sort``). Both keep the same set."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    k = top_k if top_k is not None else torch.full((num_rows,), vocab_size, device=device)
    p = top_p if top_p is not None else torch.ones(num_rows, device=device)
    is_top_k = k < vocab_size  # [num_rows]
    is_top_p = p < 1.0  # [num_rows]
    is_untouched = ~is_top_k & ~is_top_p
    max_top_k = int(torch.where(is_top_k & (k <= _MAX_CANDIDATES), k, 0).max())
    num_candidates = max(min_candidates, max_top_k)
    if num_candidates >= vocab_size:
        return _top_k_top_p_by_sort(logits, top_k, top_p)

    can_fit = ~is_untouched  # [num_rows]
    row_total = torch.ones(num_rows, dtype=torch.float64, device=device)
    if bool((is_top_p & ~is_top_k).any()):
        # row_total: [num_rows], sum(exp(logits - max)), top-p's denominator for rows without
        # top-k. Their candidates hold at most num_candidates / row_total: flat rows go to the
        # sort without a topk.
        row_total = (logits - logits.amax(dim=-1, keepdim=True)).exp_().sum(dim=-1).double()
        can_fit &= is_top_k | (num_candidates / row_total >= p.double())

    is_fast = torch.zeros_like(can_fit)
    if bool(can_fit.any()):
        # One more than the candidates: the largest logit outside them tells whether a tie with
        # the last kept token reaches past them.
        values, ids = logits.topk(num_candidates + 1, dim=-1)  # [num_rows, num_candidates + 1]
        keep, is_fast = _keep_candidates(values, k, p, row_total, vocab_size, top_p is not None)
        is_fast &= can_fit
    is_sorted = ~is_fast & ~is_untouched

    if bool(is_sorted.all()):
        return _top_k_top_p_by_sort(logits, top_k, top_p)
    if bool(is_fast.any()):
        rows = is_fast.nonzero().squeeze(1)
        kept_values = values[rows].masked_fill_(~keep[rows], -torch.inf)  # [num_fast, ...]
        masked = torch.full((len(rows), vocab_size), -torch.inf, device=device)
        logits[rows] = masked.scatter_(1, ids[rows], kept_values)
    if top_p is not None and bool(is_untouched.any()):
        # NOTE: once the batch uses top-p, the sorted path drops the tokens of float32
        # probability 0 from every row (cumulative 0 <= 1 - top_p), top_p = 1 included.
        rows = is_untouched.nonzero().squeeze(1)
        untouched = logits[rows]  # [num_untouched, vocab_size]
        logits[rows] = untouched.masked_fill_(untouched.softmax(dim=-1) == 0.0, -torch.inf)
    if bool(is_sorted.any()):
        rows = is_sorted.nonzero().squeeze(1)
        logits[rows] = _top_k_top_p_by_sort(
            logits[rows],
            top_k[rows] if top_k is not None else None,
            top_p[rows] if top_p is not None else None,
        )
    return logits


def _keep_candidates(
    values: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    row_total: torch.Tensor,
    vocab_size: int,
    uses_top_p: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p over each row's largest logits ``values: [num_rows, num_candidates + 1]``
    (descending). ``top_k``, ``top_p``: ``[num_rows]``, vocab_size and 1 when off; ``row_total``:
    ``[num_rows]`` float64 sum(exp(logits - max)) over the whole row, read for rows with top-p but
    no top-k; ``uses_top_p``: whether the batch has top-p at all.

    Returns which candidates to keep, ``[num_rows, num_candidates + 1]``, and whether that is
    exactly what the full sort keeps, ``[num_rows]``. Every mask here is a prefix of each row."""
    num_rows = values.shape[0]
    num_candidates = values.shape[1] - 1
    is_top_k = top_k < vocab_size  # [num_rows]
    is_top_p = top_p < 1.0  # [num_rows]
    # Top-k: ties with the k-th largest logit survive, as in vLLM.
    kth_index = top_k.clamp(max=num_candidates).unsqueeze(1) - 1  # [num_rows, 1]
    kth_largest = values.gather(1, kth_index).masked_fill_(~is_top_k.unsqueeze(1), -torch.inf)
    keep_top_k = values >= kth_largest
    # Top-p's probabilities below need every token top-k keeps among the candidates.
    top_k_fits = (top_k <= num_candidates) & (kth_largest.squeeze(1) > values[:, num_candidates])

    keep = keep_top_k.clone()
    num_close = torch.zeros_like(top_k)  # [num_rows]
    if uses_top_p:
        # float64 probabilities over what top-k left: the kept candidates for top-k rows, the
        # whole row for the others. The cut needs them far closer than _TOP_P_MARGIN.
        exp_values = (values.double() - values[:, :1].double()).exp_()
        exp_values.masked_fill_(~keep_top_k, 0.0)
        total = torch.where(is_top_k, exp_values.sum(dim=-1), row_total)  # [num_rows]
        probs = exp_values.div_(total.unsqueeze(1))  # [num_rows, num_candidates + 1]
        # mass_above: [num_rows, num_candidates + 1], the mass of the candidates above each one.
        mass_above = torch.cat([probs.new_zeros(num_rows, 1), probs[:, :-1].cumsum(dim=-1)], dim=1)
        p = top_p.double().unsqueeze(1)  # [num_rows, 1]
        is_close = keep_top_k & ((mass_above - p).abs() < _TOP_P_MARGIN)
        num_close = (is_close & is_top_p.unsqueeze(1)).sum(dim=-1)
        # A token is dropped once the tokens above it reach top_p: the smallest such set is left.
        keep &= (mass_above < p) | ~is_top_p.unsqueeze(1)
        # NOTE: once the batch uses top-p, the sorted path also drops tokens whose float32
        # probability rounds to 0 (cumulative 0 <= 1 - top_p, top_p = 1 included). For top-k
        # rows, the same float32 softmax over the same logits finds them.
        zero_prob = values.masked_fill(~keep_top_k, -torch.inf).softmax(dim=-1) == 0.0
        keep &= ~(zero_prob & is_top_k.unsqueeze(1))

    num_kept = keep.sum(dim=-1).clamp_(1, num_candidates)  # [num_rows]
    last_kept = values.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)  # [num_rows]
    first_dropped = values.gather(1, num_kept.unsqueeze(1)).squeeze(1)  # [num_rows]
    # The cut must fall within the candidates, not across a tie (the sorted path orders ties
    # its own way), and not within the rounding of the sorted path's top-p.
    fits = (
        (top_k_fits | ~is_top_k)
        & ~keep[:, num_candidates]
        & (last_kept > first_dropped)
        & (num_close == 0)
    )
    return keep, fits


def _top_k_top_p_by_sort(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """``_apply_top_k_top_p`` for any row, by sorting each row in full."""
    vocab_size = logits.shape[1]
    # Ascending, so the tokens to drop form a prefix of each sorted row.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)  # [num_rows, vocab_size]
    if top_k is not None:
        # Threshold at the k-th largest logit; ties with it survive, as in vLLM.
        kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))  # [num_rows, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [num_rows, vocab_size]
        # A token is dropped when all tokens at or below it hold no more than 1 - top_p, i.e. the
        # tokens above it already reach top_p: what is left is the smallest such set.
        drop = cumulative <= 1.0 - top_p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_ids, sorted_logits)


def _inverse_cdf(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Token ids ``[num_rows]`` drawn from ``probs: [num_rows, vocab_size]``: the first token whose
    cumulative probability exceeds a uniform draw. One random number per row, no CPU sync.
    (An exponential race, argmax(probs / q) with q ~ Exp(1), needs vocab_size random numbers a
    row: 35 ms for 64 x 32,000 on 2 CPU cores against 1.5 ms for this — a third of a decode
    step. torch.multinomial costs the same 35 ms.) Seeded rows draw from their own generator, so
    their tokens depend only on their seed and their own logits; the others draw from
    ``shared_generator`` (None: torch's global one), one draw each."""
    num_rows = probs.shape[0]
    # float64: summing 10^5 float32 probabilities would drift by more than the smallest ones.
    cumulative = probs.to(torch.float64).cumsum_(dim=-1)  # [num_rows, vocab_size]
    u = torch.empty(num_rows, 1, dtype=torch.float64, device=probs.device)
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    if len(seeded) < num_rows:
        u.uniform_(generator=shared_generator)
    for i, generator in seeded:
        u[i].uniform_(generator=generator)
    # Scaled by each row's total, which rounding keeps a hair off 1. A token of probability 0
    # spans an empty interval, so it is never chosen; right=True skips ties at its boundary.
    targets = u.mul_(cumulative[:, -1:])
    token_ids = torch.searchsorted(cumulative, targets, right=True).squeeze(1)
    return token_ids.clamp_(max=probs.shape[1] - 1)


def collect_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> tuple[list[dict[int, float]], list[int]]:
    """Per row of ``raw_logprobs: [num_rows, vocab_size]``: the chosen token's (``token_ids:
    [num_rows]``, sampled or the prompt's next) logprob plus those of its ``num_top[row]`` most
    likely tokens; and the chosen token's rank (1 + the tokens with a greater logprob, vLLM's,
    whatever ``num_top`` is). The sampler's and the prompt logprobs' (``model_runner``)."""
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [num_rows, 1]
    ranks = (raw_logprobs > chosen).sum(dim=-1).add_(1).tolist()  # [num_rows]
    sampled = chosen.squeeze(1).tolist()  # [num_rows]
    max_top = min(max(num_top, default=0), raw_logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in num_top]
    top_ids: list[list[int]] = [[] for _ in num_top]
    if max_top > 0:
        values, ids = raw_logprobs.topk(max_top, dim=-1)  # [num_rows, max_top] each
        top_values, top_ids = values.tolist(), ids.tolist()
    rows = []
    for row, (token_id, n) in enumerate(zip(token_ids.tolist(), num_top, strict=True)):
        entries = {token_id: sampled[row]}
        entries.update(zip(top_ids[row][:n], top_values[row][:n], strict=True))
        rows.append(entries)
    return rows, ranks


def _mask_by_grammar(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """In place: ``apply_grammar_bitmask`` on the batch's constrained rows."""
    if metadata.grammar_bitmask is not None:
        apply_grammar_bitmask(logits, metadata.grammar_bitmask, metadata.grammar_rows)
    return logits


_LOGITS_STEPS = (
    _LogitsStep(
        applies=lambda m: any(
            len(output) < p.min_tokens
            for p, output in zip(m.params, m.output_token_ids, strict=True)
        ),
        apply=_mask_stop_tokens,
    ),
    _LogitsStep(
        applies=lambda m: any(p.allowed_token_ids for p in m.params),
        apply=lambda logits, m, _: _keep_allowed_tokens(logits, m),
    ),
    _LogitsStep(
        applies=lambda m: any(p.bad_words_token_ids for p in m.params),
        apply=lambda logits, m, _: _ban_bad_words(logits, m),
    ),
    _LogitsStep(
        applies=lambda m: any(p.logit_bias for p in m.params),
        apply=lambda logits, m, _: _add_logit_bias(logits, m),
    ),
    _LogitsStep(
        applies=lambda m: any(p.has_penalties for p in m.params),
        apply=lambda logits, m, _: _apply_penalties(logits, m),
    ),
    _LogitsStep(
        applies=lambda m: m.grammar_bitmask is not None,
        apply=lambda logits, m, _: _mask_by_grammar(logits, m),
    ),
)
"""The steps of ``process_logits``, in order (the module docstring's steps 2-5)."""
