"""Top-k / top-p masking: the candidate path must keep exactly the tokens a full sort keeps.

``reference_top_k_top_p`` is the sampler's implementation before the candidate path, kept here
as the definition of what survives; every test compares whole masked batches with it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from services.engine import sampler
from services.engine.sampler import _apply_top_k_top_p

VOCAB_SIZE = 32_000
OFF = -1
"""top_k of a row without top-k (as in ``SamplingParams``)."""


def reference_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Sort every row in full; mask to -inf what top-k, then top-p, drop."""
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1.0 - top_p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_ids, sorted_logits)


def make_logits(
    num_rows: int, *, seed: int, scale: float, vocab_size: int = VOCAB_SIZE
) -> torch.Tensor:
    """``[num_rows, vocab_size]``: scale 8 is peaked like a trained model, 1 flat like ours."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale


def make_settings(
    top_k: list[int], top_p: list[float], vocab_size: int = VOCAB_SIZE
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-row settings as ``_sample_random`` passes them: None where no row uses one."""
    k = [x if 0 < x < vocab_size else vocab_size for x in top_k]
    use_top_k = any(x < vocab_size for x in k)
    use_top_p = any(x < 1.0 for x in top_p)
    return (
        torch.tensor(k, dtype=torch.long) if use_top_k else None,
        torch.tensor(top_p, dtype=torch.float32) if use_top_p else None,
    )


def count_sorted_rows(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Counts the rows ``_apply_top_k_top_p`` sorts in full from now on."""
    num_sorted = [0]
    sort = sampler._top_k_top_p_by_sort

    def counting_sort(
        logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> torch.Tensor:
        num_sorted[0] += logits.shape[0]
        return sort(logits, top_k, top_p)

    monkeypatch.setattr(sampler, "_top_k_top_p_by_sort", counting_sort)
    return lambda: num_sorted[0]


def assert_same_as_reference(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], **kwargs: int
) -> torch.Tensor:
    """Mask ``logits`` both ways; the surviving positions and their logits must be identical."""
    k, p = make_settings(top_k, top_p, logits.shape[1])
    expected = reference_top_k_top_p(logits.clone(), k, p)
    actual = _apply_top_k_top_p(logits.clone(), k, p, **kwargs)
    for row in range(logits.shape[0]):
        kept = set(actual[row].isfinite().nonzero().flatten().tolist())
        expected_kept = set(expected[row].isfinite().nonzero().flatten().tolist())
        assert kept == expected_kept, (
            f"row {row} (top_k={top_k[row]}, top_p={top_p[row]}): "
            f"{len(kept - expected_kept)} extra, {len(expected_kept - kept)} missing"
        )
    assert torch.equal(actual, expected)
    return actual


def test_peaked_top_p_rows_take_the_candidate_path(monkeypatch: pytest.MonkeyPatch) -> None:
    num_sorted = count_sorted_rows(monkeypatch)
    generator = torch.Generator().manual_seed(1)
    top_p = (0.5 + 0.49 * torch.rand(32, generator=generator)).tolist()
    kept = assert_same_as_reference(make_logits(32, seed=1, scale=8.0), [OFF] * 32, top_p)
    assert num_sorted() <= 2, "a peaked nucleus fits in the candidates"
    assert (kept.isfinite().sum(dim=-1) > 1).any(), "a degenerate case would not test top-p"


def test_flat_top_p_rows_are_sorted(monkeypatch: pytest.MonkeyPatch) -> None:
    num_sorted = count_sorted_rows(monkeypatch)
    assert_same_as_reference(make_logits(8, seed=2, scale=1.0), [OFF] * 8, [0.9] * 8)
    assert num_sorted() == 8, "a flat nucleus holds thousands of tokens"


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_top_k_only(monkeypatch: pytest.MonkeyPatch, scale: float) -> None:
    num_sorted = count_sorted_rows(monkeypatch)
    top_k = [1, 2, 5, 20, 50, 256, 300, OFF]
    assert_same_as_reference(make_logits(8, seed=3, scale=scale), top_k, [1.0] * 8)
    assert num_sorted() == 0, "distinct logits never tie at the k-th largest"


@pytest.mark.parametrize("scale", [1.0, 4.0, 8.0])
def test_top_k_and_top_p(scale: float) -> None:
    top_k = [5, 50, 50, 200, 1000, OFF, OFF, 40]
    top_p = [0.5, 0.9, 0.99, 0.8, 0.95, 0.9, 1.0, 1.0]
    assert_same_as_reference(make_logits(8, seed=4, scale=scale), top_k, top_p)


def test_peaked_and_flat_rows_in_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    num_sorted = count_sorted_rows(monkeypatch)
    peaked = make_logits(6, seed=5, scale=8.0)
    flat = make_logits(6, seed=6, scale=1.0)
    logits = torch.stack([row for pair in zip(peaked, flat, strict=True) for row in pair])
    top_k = [OFF, OFF, 50, 50, OFF, OFF, 20, 20, OFF, OFF, 100, 100]
    top_p = [0.9, 0.9, 1.0, 1.0, 0.7, 0.7, 0.8, 0.8, 1.0, 1.0, 0.95, 0.95]
    assert_same_as_reference(logits, top_k, top_p)
    # The flat top-p-only rows are sorted; every peaked row fits.
    assert num_sorted() == 2


def test_ties_at_the_cut_are_sorted() -> None:
    # Few distinct values: the k-th largest and the top-p cut both fall inside runs of ties.
    generator = torch.Generator().manual_seed(7)
    logits = torch.randint(0, 12, (8, VOCAB_SIZE), generator=generator).float()
    top_k = [1, 10, 300, 3000, OFF, OFF, 50, 600]
    top_p = [1.0, 1.0, 1.0, 1.0, 0.5, 0.99, 0.3, 0.9]
    assert_same_as_reference(logits, top_k, top_p)


def test_ties_across_the_candidates_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    # The 30 largest logits are distinct; the next 1,000 all equal, so a cut after the 30th
    # fits the candidates and one after the 31st reaches past them.
    num_sorted = count_sorted_rows(monkeypatch)
    logits = make_logits(4, seed=8, scale=1.0) - 10.0
    logits[:, :30] = torch.arange(40.0, 10.0, -1.0)
    logits[:, 30:1030] = 5.0
    assert_same_as_reference(logits, [30, 31, 200, OFF], [1.0, 1.0, 1.0, 1.0])
    assert num_sorted() == 2


def test_top_k_beyond_the_largest_candidate_count() -> None:
    top_k = [sampler._MAX_CANDIDATES + 1, 10_000, 50, 3, sampler._MAX_CANDIDATES, OFF]
    top_p = [1.0, 0.9, 1.0, 0.5, 0.95, 0.9]
    assert_same_as_reference(make_logits(6, seed=9, scale=8.0), top_k, top_p)


def test_small_candidate_counts() -> None:
    # Fewer candidates than the nucleus: the same set, through more sorted rows.
    top_k = [OFF, 5, 40, OFF, 3, OFF]
    top_p = [0.9, 0.9, 1.0, 0.6, 1.0, 0.99]
    for min_candidates in (1, 4, 16):
        logits = make_logits(6, seed=10 + min_candidates, scale=6.0, vocab_size=500)
        assert_same_as_reference(logits, top_k, top_p, min_candidates=min_candidates)


def test_masked_tokens() -> None:
    # Stop-token masking and penalties leave -inf, at the top of a row too; rows with fewer
    # finite logits than top_k keep all of them.
    generator = torch.Generator().manual_seed(11)
    logits = make_logits(8, seed=11, scale=8.0)
    logits.masked_fill_(torch.rand(logits.shape, generator=generator) < 0.05, float("-inf"))
    logits[0, logits[0].argmax()] = float("-inf")
    logits[1, 10:] = float("-inf")
    logits[2, 300:] = float("-inf")
    logits[3, 1:] = float("-inf")
    top_k = [20, 50, 100, OFF, 50, OFF, 5, 1000]
    top_p = [0.9, 1.0, 0.9, 0.5, 1.0, 0.99, 0.3, 1.0]
    assert_same_as_reference(logits, top_k, top_p)


def test_tokens_whose_probability_rounds_to_zero() -> None:
    # Temperature 0.05 spreads the logits over hundreds of nats: the full sort drops tokens of
    # float32 probability 0 from every row once the batch uses top-p, top_p = 1 included.
    logits = make_logits(6, seed=12, scale=8.0 / 0.05)
    top_k = [50, 300, OFF, OFF, 5, 2000]
    top_p = [1.0, 1.0, 1.0, 0.9, 0.99, 1.0]
    assert_same_as_reference(logits, top_k, top_p)
    assert_same_as_reference(logits, top_k, [1.0] * 6)


def test_tiny_top_p_keeps_the_most_likely_token() -> None:
    logits = make_logits(4, seed=13, scale=1.0)
    kept = assert_same_as_reference(logits, [OFF, 50, OFF, 1], [1e-7, 1e-7, 1e-3, 0.5])
    assert kept.isfinite().sum(dim=-1).tolist() == [1, 1, 1, 1]
    assert torch.equal(kept.argmax(dim=-1), logits.argmax(dim=-1))


def test_vocab_smaller_than_the_candidates() -> None:
    logits = make_logits(4, seed=14, scale=4.0, vocab_size=100)
    assert_same_as_reference(logits, [5, OFF, 50, OFF], [0.9, 0.8, 1.0, 1.0])


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed: int) -> None:
    """Random per-row settings and scales, flat to very peaked, in one batch."""
    generator = torch.Generator().manual_seed(100 + seed)
    num_rows = 24
    scales = torch.tensor([0.5, 1.0, 3.0, 8.0, 20.0])[
        torch.randint(0, 5, (num_rows, 1), generator=generator)
    ]
    logits = torch.randn(num_rows, 4000, generator=generator) * scales
    k_choices = [OFF, OFF, 1, 2, 10, 50, 256, 257, 1000]
    p_choices = [1.0, 1.0, 0.1, 0.5, 0.9, 0.95, 0.999]
    top_k = [k_choices[i] for i in torch.randint(0, 9, (num_rows,), generator=generator)]
    top_p = [p_choices[i] for i in torch.randint(0, 7, (num_rows,), generator=generator)]
    assert_same_as_reference(logits, top_k, top_p)
