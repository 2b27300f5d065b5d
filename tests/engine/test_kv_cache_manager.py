"""KVCacheManager: block tables, chained-hash prefix caching, eviction and stats."""

from __future__ import annotations

import pytest

from services.engine.kv_cache_manager import KVCacheManager, hash_block_tokens
from services.engine.request import Request


def admit(kv: KVCacheManager, request: Request) -> int:
    """What the scheduler does for a whole prompt in one step: hit, allocate, compute, cache.

    Returns the number of prefix-hit tokens.
    """
    computed_blocks, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit
    assert kv.can_allocate(request, num_new, computed_blocks)
    kv.allocate(request, num_new, computed_blocks)
    kv.record_prefix_lookup(request.num_tokens, num_hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return num_hit


@pytest.mark.parametrize(
    ("num_tokens", "num_blocks"), [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)]
)
def test_blocks_needed_for_tokens(make_kv_manager, num_tokens: int, num_blocks: int) -> None:
    assert make_kv_manager(block_size=4).num_blocks_for(num_tokens) == num_blocks


def test_allocate_gives_a_slot_per_token_and_free_returns_them(
    make_kv_manager, make_request, assert_all_free
) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4)
    request = make_request("a", 6)

    kv.allocate(request, 6)
    assert len(kv.block_ids("a")) == 2
    request.num_computed_tokens = 6
    # Two more tokens still fit the second block; a third needs another.
    kv.allocate(request, 2)
    assert len(kv.block_ids("a")) == 2
    request.num_computed_tokens = 8
    assert kv.can_allocate(request, 1)
    kv.allocate(request, 1)
    assert len(kv.block_ids("a")) == 3
    assert kv.num_free_blocks == 5

    kv.free(request)
    assert kv.block_ids("a") == []
    assert_all_free(kv)


def test_try_allocate_is_can_allocate_then_allocate(
    make_kv_manager, make_request, assert_all_free
) -> None:
    kv = make_kv_manager(num_blocks=3, block_size=4)
    a, b = make_request("a", 6), make_request("b", 4)
    kv.allocate(a, 6)
    a.num_computed_tokens = 6
    held = kv.block_ids("a")
    # A decode step that fits the last block takes nothing.
    assert kv.try_allocate(a, 1) and kv.block_ids("a") == held
    a.num_computed_tokens = 8
    # At the boundary, one block more.
    assert kv.try_allocate(a, 1) and len(kv.block_ids("a")) == 3
    a.num_computed_tokens = 9
    # The pool is empty: refused, and nothing is held that was not before.
    kv.allocate(b, 0)
    b.num_computed_tokens = 0
    assert not kv.try_allocate(b, 4)
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 0
    kv.free(a)
    assert kv.try_allocate(b, 4) and len(kv.block_ids("b")) == 1
    kv.free(b)
    assert_all_free(kv)


def test_block_ids_follow_the_blocks_and_are_a_copy(make_kv_manager, make_request) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4)
    first = make_request("first", token_ids=list(range(9)))
    admit(kv, first)
    # A second request hits the first's full blocks, then allocates its own.
    second = make_request("second", token_ids=[*range(8), 50, 51, 52, 53])
    assert admit(kv, second) == 8
    for name in ("first", "second"):
        assert kv.block_ids(name) == [block.block_id for block in kv._blocks[name]]
    assert kv.block_ids("second")[:2] == kv.block_ids("first")[:2]
    ids = kv.block_ids("second")
    ids.append(999)
    assert 999 not in kv.block_ids("second")


def test_can_allocate_refuses_beyond_free_blocks(make_kv_manager, make_request) -> None:
    kv = make_kv_manager(num_blocks=2, block_size=4)
    assert kv.can_allocate(make_request("a", 8), 8)
    assert not kv.can_allocate(make_request("b", 9), 9)


def test_prefix_hit_after_blocks_are_cached_and_freed(
    make_kv_manager, make_request, assert_all_free
) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4)
    tokens = list(range(100, 110))
    first = make_request("first", token_ids=tokens)
    assert admit(kv, first) == 0
    first_blocks = kv.block_ids("first")
    kv.free(first)

    second = make_request("second", token_ids=tokens + [7, 7])
    computed_blocks, num_hit = kv.get_computed_blocks(second)

    assert num_hit == 8
    assert [b.block_id for b in computed_blocks] == first_blocks[:2]
    kv.allocate(second, second.num_tokens - num_hit, computed_blocks)
    assert kv.block_ids("second")[:2] == first_blocks[:2]
    assert len(kv.block_ids("second")) == 3
    assert [b.ref_count for b in computed_blocks] == [1, 1]
    kv.free(second)
    assert_all_free(kv)


def test_hit_never_covers_the_whole_prompt(make_kv_manager, make_request, assert_all_free) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4)
    tokens = list(range(100, 112))  # exactly 3 full blocks
    first = make_request("first", token_ids=tokens)
    admit(kv, first)
    assert kv.pool.num_cached_blocks == 3
    kv.free(first)

    same = make_request("same", token_ids=tokens)
    _, num_hit = kv.get_computed_blocks(same)

    # The last token is recomputed for its logits, so the last block is not a hit.
    assert num_hit == 8
    assert_all_free(kv)


def test_hit_is_limited_to_full_blocks(make_kv_manager, make_request, assert_all_free) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4)
    first = make_request("first", token_ids=list(range(100, 114)))
    admit(kv, first)
    kv.free(first)

    # Shares 6 tokens with the cached prompt: one full block and half of the next.
    partial = make_request("partial", token_ids=list(range(100, 106)) + [1, 1, 1, 1])
    _, num_hit = kv.get_computed_blocks(partial)

    assert num_hit == 4
    assert_all_free(kv)


def test_partial_tail_block_is_never_cached(make_kv_manager, make_request, assert_all_free) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4)
    request = make_request("a", token_ids=list(range(100, 106)))
    admit(kv, request)

    tail = kv.pool.blocks[kv.block_ids("a")[1]]
    assert tail.block_hash is None
    assert kv.pool.num_cached_blocks == 1
    kv.free(request)

    # The same 6 tokens plus more: only the first block can hit.
    longer = make_request("longer", token_ids=list(range(100, 106)) + [5, 5, 5, 5])
    _, num_hit = kv.get_computed_blocks(longer)
    assert num_hit == 4
    assert_all_free(kv)


def test_cache_full_blocks_caches_only_computed_tokens(
    make_kv_manager, make_request, assert_all_free
) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4)
    request = make_request("a", token_ids=list(range(100, 112)))
    kv.allocate(request, 12)

    request.num_computed_tokens = 5  # a first chunk of 5 tokens
    kv.cache_full_blocks(request)
    assert kv.pool.num_cached_blocks == 1
    request.num_computed_tokens = 12
    kv.cache_full_blocks(request)
    assert kv.pool.num_cached_blocks == 3

    kv.free(request)
    assert_all_free(kv)


def test_same_block_tokens_after_a_different_prefix_do_not_hit(
    make_kv_manager, make_request, assert_all_free
) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4)
    block_a, block_b, tail = [1, 2, 3, 4], [5, 6, 7, 8], [9]
    first = make_request("first", token_ids=block_a + block_b + tail)
    admit(kv, first)
    kv.free(first)

    # block_b again, but at position 0 and after another prefix: its hash differs both times.
    moved = make_request("moved", token_ids=block_b + block_b + tail)
    other_prefix = make_request("other", token_ids=[4, 3, 2, 1] + block_b + tail)

    assert kv.get_computed_blocks(moved) == ([], 0)
    assert kv.get_computed_blocks(other_prefix) == ([], 0)
    assert hash_block_tokens(b"x", block_b) != hash_block_tokens(b"y", block_b)
    assert_all_free(kv)


def test_a_salted_prompt_hits_only_blocks_of_its_own_salt(
    make_kv_manager, make_request, assert_all_free
) -> None:
    kv = make_kv_manager(num_blocks=16, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]

    def hit(name: str, salt: str | None) -> int:
        request = make_request(name, token_ids=prompt, cache_salt=salt)
        num_hit = admit(kv, request)
        kv.free(request)
        return num_hit

    assert hit("plain", None) == 0
    assert hit("a1", "a") == 0  # the unsalted blocks are not tenant a's
    assert hit("a2", "a") == 8
    assert hit("b1", "b") == 0
    assert hit("plain again", None) == 8
    assert_all_free(kv)


def test_live_requests_share_prefix_blocks(make_kv_manager, make_request, assert_all_free) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4)
    prefix = list(range(100, 108))
    first = make_request("first", token_ids=prefix + [1, 1])
    admit(kv, first)

    second = make_request("second", token_ids=prefix + [2, 2, 2])
    assert admit(kv, second) == 8

    shared = kv.block_ids("first")[:2]
    assert kv.block_ids("second")[:2] == shared
    assert kv.block_ids("second")[2] != kv.block_ids("first")[2]
    assert [kv.pool.blocks[i].ref_count for i in shared] == [2, 2]
    assert kv.num_free_blocks == 8 - 4

    kv.free(first)
    assert [kv.pool.blocks[i].ref_count for i in shared] == [1, 1]
    assert kv.block_ids("second")[:2] == shared
    assert kv.num_free_blocks == 8 - 3
    # The shared blocks are still held, so no allocation can take them.
    third = make_request("third", num_tokens=20)
    kv.allocate(third, 20)
    assert not set(kv.block_ids("third")) & set(kv.block_ids("second"))

    kv.free(third)
    kv.free(second)
    assert_all_free(kv)


def test_free_cached_blocks_count_against_can_allocate_on_a_hit(
    make_kv_manager, make_request, assert_all_free
) -> None:
    kv = make_kv_manager(num_blocks=3, block_size=4)
    tokens = list(range(100, 109))
    first = make_request("first", token_ids=tokens)
    admit(kv, first)
    kv.free(first)

    # The hit takes 2 free cached blocks out of the queue; 1 new block is needed besides.
    second = make_request("second", token_ids=tokens)
    computed_blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8
    assert kv.can_allocate(second, 1, computed_blocks)
    assert not kv.can_allocate(second, 5, computed_blocks)
    assert_all_free(kv)


def test_eviction_reuses_lru_cached_blocks_and_drops_their_hashes(
    make_kv_manager, make_request, assert_all_free
) -> None:
    kv = make_kv_manager(num_blocks=4, block_size=4)
    tokens = list(range(100, 109))  # 2 full blocks + 1 token
    first = make_request("first", token_ids=tokens)
    admit(kv, first)
    block_0, block_1, _ = kv.block_ids("first")
    hash_1 = first.block_hashes[1]
    kv.free(first)  # tail first: free queue is now [3, tail, block_1, block_0]
    assert kv.pool.num_cached_blocks == 2

    other = make_request("other", num_tokens=12)
    admit(kv, other)

    # The unused block, the uncached tail, then the LRU cached block were taken; block_0 survives.
    assert block_1 in kv.block_ids("other")
    assert block_0 not in kv.block_ids("other")
    assert kv.pool.get_cached_block(hash_1) is None
    assert kv.pool.get_cached_block(first.block_hashes[0]).block_id == block_0
    kv.free(other)

    again = make_request("again", token_ids=tokens)
    assert kv.get_computed_blocks(again)[1] == 4
    assert_all_free(kv)


def test_prefix_cache_stats(make_kv_manager, make_request, assert_all_free) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4)
    assert kv.prefix_cache_stats.hit_rate == 0.0
    tokens = list(range(100, 110))
    first = make_request("first", token_ids=tokens)
    admit(kv, first)
    kv.free(first)
    second = make_request("second", token_ids=tokens)
    admit(kv, second)
    kv.free(second)

    stats = kv.prefix_cache_stats
    assert stats.num_queried_tokens == 20
    assert stats.num_hit_tokens == 8
    assert stats.hit_rate == pytest.approx(0.4)
    assert_all_free(kv)


def test_caching_disabled_never_hits(make_kv_manager, make_request, assert_all_free) -> None:
    kv = make_kv_manager(num_blocks=8, block_size=4, caching=False)
    tokens = list(range(100, 110))
    first = make_request("first", token_ids=tokens)
    admit(kv, first)
    assert kv.pool.num_cached_blocks == 0
    kv.free(first)

    second = make_request("second", token_ids=tokens)
    assert admit(kv, second) == 0
    assert kv.prefix_cache_stats.num_hit_tokens == 0
    kv.free(second)
    assert_all_free(kv)


def test_free_releases_tail_first(make_kv_manager, make_request) -> None:
    kv = make_kv_manager(num_blocks=3, block_size=4)
    request = make_request("a", num_tokens=12)
    admit(kv, request)
    block_ids = kv.block_ids("a")
    kv.free(request)
    # The tail of a sequence is evicted before its prefix.
    assert [[b.block_id for b in kv.pool.allocate(1)] for _ in range(3)] == [
        [block_id] for block_id in block_ids[::-1]
    ]


def test_growing_sequences_keep_their_blocks_in_a_row(make_kv_manager, make_request) -> None:
    kv = make_kv_manager(num_blocks=64, block_size=4)
    requests = [make_request(name, num_tokens=8, max_tokens=40) for name in "abc"]
    for request in requests:
        admit(kv, request)
    for _ in range(20):  # decode steps, the three interleaved
        for request in requests:
            assert kv.try_allocate(request, 1)
            request.num_computed_tokens += 1

    for request in requests:
        held = kv.block_ids(request.request_id)
        assert len(held) == 7
        assert held == list(range(held[0], held[0] + 7))


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
