"""BlockPool: reference counts, the LRU free queue and the prefix-cache index."""

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

    pool.free([blocks[2], blocks[0]])
    pool.free([blocks[3]])
    pool.free([blocks[1]])

    # Least recently freed first.
    assert ids(pool.allocate(4)) == [2, 0, 3, 1]


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


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_needs_a_block(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)
