"""BlockPool: reference counts, free runs, the LRU queue of cached blocks, the prefix index."""

from __future__ import annotations

import pytest

from services.engine.block_pool import BlockPool


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def test_allocate_and_free_count_references() -> None:
    pool = BlockPool(4)

    blocks = pool.allocate(3)

    assert len(set(ids(blocks))) == 3
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.num_used_blocks == 3
    pool.free(blocks)
    assert [b.ref_count for b in blocks] == [0, 0, 0]
    assert pool.num_free_blocks == 4
    assert pool.num_used_blocks == 0


def test_fresh_pool_hands_out_blocks_in_id_order() -> None:
    pool = BlockPool(4)
    assert ids(pool.allocate(4)) == [0, 1, 2, 3]


def test_free_order_is_eviction_order() -> None:
    pool = BlockPool(4)
    blocks = {b.block_id: b for b in pool.allocate(4)}
    for block_id, block in blocks.items():
        pool.cache_block(block, f"h{block_id}".encode())

    pool.free([blocks[2], blocks[0]])
    pool.free([blocks[3]])
    pool.free([blocks[1]])

    # Least recently freed first, one eviction per block asked for.
    assert [ids(pool.allocate(1)) for _ in range(4)] == [[2], [0], [3], [1]]


def test_uncached_free_blocks_go_before_any_cached_block_is_evicted() -> None:
    pool = BlockPool(4)
    cached, plain = pool.allocate(2)
    pool.cache_block(cached, b"h")
    pool.free([cached])  # freed first: an LRU queue would hand it out first
    pool.free([plain])

    assert sorted(ids(pool.allocate(3))) == sorted([plain.block_id, 2, 3])
    assert pool.get_cached_block(b"h") is cached


def test_a_sequence_grows_into_the_blocks_after_its_last() -> None:
    pool = BlockPool(64)
    first = ids(pool.allocate(4))
    second = ids(pool.allocate(4))

    assert ids(pool.allocate(2, after=first[-1])) == [first[-1] + 1, first[-1] + 2]
    assert ids(pool.allocate(1, after=second[-1])) == [second[-1] + 1]


def test_growth_blocked_by_a_block_in_use_goes_elsewhere() -> None:
    pool = BlockPool(8)
    first = ids(pool.allocate(2))
    pool.allocate(6)  # everything after the first sequence
    pool.free([pool.blocks[7]])

    assert ids(pool.allocate(1, after=first[-1])) == [7]


def test_growth_does_not_evict_a_cached_successor() -> None:
    pool = BlockPool(8)
    first = ids(pool.allocate(2))
    rest = pool.allocate(6)
    pool.cache_block(rest[0], b"next")  # block 2, right after the first sequence
    pool.free(rest)

    [grown] = ids(pool.allocate(1, after=first[-1]))

    assert grown != 2 and pool.get_cached_block(b"next") is pool.blocks[2]


def test_eviction_makes_a_run_for_a_new_sequence() -> None:
    # Cached free blocks 0..7 in LRU order 7, 6, ..., 0 (a sequence's tail goes first), one
    # uncached free block (9) apart from them.
    pool = BlockPool(10)
    blocks = pool.allocate(10)
    for block in blocks[:8]:
        pool.cache_block(block, f"h{block.block_id}".encode())
    pool.free(reversed(blocks[:8]))
    pool.free([blocks[9]])

    new = ids(pool.allocate(3))

    # Not block 9 and two evicted ones: three evicted from the LRU end, in a row.
    assert new == [5, 6, 7]
    assert pool.num_cached_blocks == 5


def test_eviction_for_a_run_is_bounded() -> None:
    # Every other block cached and free: no run of two can be made without evicting all.
    pool = BlockPool(12)
    blocks = pool.allocate(12)
    for block in blocks[::2]:
        pool.cache_block(block, f"h{block.block_id}".encode())
    pool.free(blocks[::2])

    assert len(pool.allocate(2)) == 2
    # Two evictions are needed, and at most two more made while looking for a run.
    assert pool.num_cached_blocks == 2


def test_shared_block_is_free_only_after_its_last_reference() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2

    pool.free([block])
    assert block.ref_count == 1
    assert pool.num_free_blocks == 1
    assert not pool.can_allocate(2)

    pool.free([block])
    assert block.ref_count == 0
    assert pool.num_free_blocks == 2


def test_touch_revives_a_free_cached_block() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.cache_block(block, b"h0")
    pool.free([block])
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(b"h0") is block

    pool.touch([pool.get_cached_block(b"h0")])

    assert block.ref_count == 1
    assert pool.num_free_blocks == 3
    assert block.block_hash == b"h0"
    # Out of the free queue: allocating everything else never hands it out.
    assert block.block_id not in ids(pool.allocate(3))
    assert not pool.can_allocate(1)


def test_allocating_a_free_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache_block(first, b"h-first")
    pool.cache_block(second, b"h-second")
    pool.free([first, second])
    assert pool.num_cached_blocks == 2

    [reused] = pool.allocate(1)

    assert reused is first
    assert reused.block_hash is None
    assert pool.get_cached_block(b"h-first") is None
    assert pool.get_cached_block(b"h-second") is second
    assert pool.num_cached_blocks == 1


def test_caching_the_same_hash_twice_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)

    pool.cache_block(first, b"same")
    pool.cache_block(second, b"same")

    assert pool.get_cached_block(b"same") is first
    assert second.block_hash is None
    assert pool.num_cached_blocks == 1
    # The private duplicate leaves no trace in the index when it is reused.
    pool.free([second])
    pool.allocate(3)
    assert pool.get_cached_block(b"same") is first


def test_caching_a_block_twice_keeps_its_first_hash() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache_block(block, b"a")
    pool.cache_block(block, b"b")
    assert block.block_hash == b"a"
    assert pool.get_cached_block(b"b") is None


def test_cache_disabled_indexes_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.allocate(1)
    pool.cache_block(block, b"h")
    assert pool.get_cached_block(b"h") is None
    assert block.block_hash is None
    assert pool.num_cached_blocks == 0


def test_can_allocate_counts_free_cached_blocks() -> None:
    pool = BlockPool(3)
    assert pool.can_allocate(3)
    assert not pool.can_allocate(4)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], b"h")
    assert pool.can_allocate(1)
    assert not pool.can_allocate(2)
    pool.free(blocks)
    assert pool.can_allocate(3)


def test_allocate_beyond_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_freeing_a_free_block_asserts() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="double free of block 0"):
        pool.free([block])
    assert pool.num_free_blocks == 2


def test_usage_is_the_fraction_of_blocks_in_use() -> None:
    pool = BlockPool(4)
    assert pool.usage == 0.0
    blocks = pool.allocate(3)
    assert pool.usage == 0.75
    pool.cache_block(blocks[0], b"h")
    pool.free(blocks[:1])
    # A free cached block does not count as used.
    assert pool.usage == 0.5
    pool.free(blocks[1:])
    assert pool.usage == 0.0


def test_reset_prefix_cache_forgets_hashes() -> None:
    pool = BlockPool(2)
    live, dead = pool.allocate(2)
    pool.cache_block(live, b"live")
    pool.cache_block(dead, b"dead")
    pool.free([dead])

    pool.reset_prefix_cache()

    assert pool.num_cached_blocks == 0
    assert live.block_hash is None and dead.block_hash is None
    assert live.ref_count == 1
    assert pool.get_cached_block(b"dead") is None
    # The free one is an ordinary free block again, in a run with its free neighbours.
    assert pool.num_free_blocks == 1
    assert ids(pool.allocate(1, after=live.block_id)) == [dead.block_id]


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_needs_a_block(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)
