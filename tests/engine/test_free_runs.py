"""FreeRuns: maximal runs of free block ids, grown in place and placed in the largest gap."""

from __future__ import annotations

import random

import pytest

from services.engine.free_runs import FreeRuns


def taken_everything_but(runs: FreeRuns, free: list[int], num_blocks: int) -> FreeRuns:
    """``runs`` after every block was taken and then ``free`` given back, in that order."""
    assert runs.take(num_blocks) == list(range(num_blocks))
    for block_id in free:
        runs.add(block_id)
    return runs


def test_a_fresh_pool_is_one_run() -> None:
    runs = FreeRuns(8)
    assert runs.runs() == [(0, 8)]
    assert runs.num_blocks == 8 and runs.max_run_length == 8


def test_empty() -> None:
    runs = FreeRuns(0)
    assert runs.runs() == [] and runs.num_blocks == 0 and runs.max_run_length == 0


def test_add_merges_with_the_runs_on_both_sides() -> None:
    runs = taken_everything_but(FreeRuns(8), [1, 2, 5], 8)
    assert runs.runs() == [(1, 3), (5, 6)]

    runs.add(4)  # joins the run after it
    assert runs.runs() == [(1, 3), (4, 6)]
    runs.add(3)  # bridges the two
    assert runs.runs() == [(1, 6)]
    assert runs.num_blocks == 5 and runs.max_run_length == 5


def test_take_starts_at_block_0_where_no_sequence_can_grow_into_it() -> None:
    runs = FreeRuns(16)
    assert runs.take(4) == [0, 1, 2, 3]
    assert runs.runs() == [(4, 16)]


def test_take_places_in_the_middle_of_the_largest_run() -> None:
    runs = FreeRuns(32)
    first = runs.take(4)

    second = runs.take(4)

    # Room for the first sequence to grow (blocks 4..15) and for the second (20..31).
    assert first == [0, 1, 2, 3]
    assert second == [16, 17, 18, 19]
    assert runs.runs() == [(4, 16), (20, 32)]


def test_take_prefers_the_largest_run() -> None:
    runs = taken_everything_but(FreeRuns(20), [1, 2, *range(6, 16)], 20)

    assert runs.take(2) == [10, 11]  # the middle of 6..15, not 1..2
    assert runs.runs() == [(1, 3), (6, 10), (12, 16)]


def test_take_a_run_that_fits_exactly_takes_it_whole() -> None:
    runs = taken_everything_but(FreeRuns(10), [2, 3, 4, 7], 10)
    assert runs.take(3) == [2, 3, 4]
    assert runs.runs() == [(7, 8)]


def test_take_more_than_any_run_takes_whole_runs_largest_first() -> None:
    runs = taken_everything_but(FreeRuns(12), [0, 3, 4, 5, 8, 9], 12)

    assert runs.take(5) == [3, 4, 5, 8, 9]
    assert runs.runs() == [(0, 1)]
    assert runs.num_blocks == 1


def test_take_after_grows_a_sequence_in_place() -> None:
    runs = FreeRuns(16)
    blocks = runs.take(2)

    assert runs.take_after(blocks[-1], 3) == [2, 3, 4]
    assert runs.runs() == [(5, 16)]


def test_take_after_stops_at_the_end_of_the_run() -> None:
    runs = taken_everything_but(FreeRuns(8), [3, 4], 8)
    assert runs.take_after(2, 5) == [3, 4]
    assert runs.runs() == []


def test_take_after_a_block_whose_successor_is_not_free_takes_nothing() -> None:
    runs = taken_everything_but(FreeRuns(8), [5, 6], 8)
    assert runs.take_after(3, 2) == []
    assert runs.take_after(7, 1) == []  # past the last block
    assert runs.runs() == [(5, 7)]


def test_adding_a_free_block_again_asserts() -> None:
    runs = taken_everything_but(FreeRuns(8), [3, 4, 5], 8)
    for block_id in (3, 5):
        with pytest.raises(AssertionError):
            runs.add(block_id)


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_keeps_the_runs_exactly_the_free_blocks(seed: int) -> None:
    """Against a plain set of free ids: runs stay maximal, cover the free blocks exactly, and
    every take hands out free blocks (in a row where the largest run holds them)."""
    rng = random.Random(seed)
    num_blocks = 200
    runs = FreeRuns(num_blocks)
    free = set(range(num_blocks))
    held: list[int] = []
    for _ in range(3000):
        if held and (rng.random() < 0.5 or not free):
            block_id = held.pop(rng.randrange(len(held)))
            runs.add(block_id)
            free.add(block_id)
        elif held and rng.random() < 0.3:
            grown = runs.take_after(rng.choice(held), rng.randint(1, 4))
            assert set(grown) <= free
            held.extend(grown)
            free -= set(grown)
        else:
            num_wanted = rng.randint(1, min(12, len(free)))
            longest = runs.max_run_length
            taken = runs.take(num_wanted)
            assert len(taken) == num_wanted and set(taken) <= free
            if longest >= num_wanted:
                assert taken == list(range(taken[0], taken[0] + num_wanted))
            held.extend(taken)
            free -= set(taken)
        expected = []
        for block_id in sorted(free):
            if expected and expected[-1][1] == block_id:
                expected[-1] = (expected[-1][0], block_id + 1)
            else:
                expected.append((block_id, block_id + 1))
        assert runs.runs() == expected
        assert runs.num_blocks == len(free)
        assert runs.max_run_length == max((end - start for start, end in expected), default=0)
