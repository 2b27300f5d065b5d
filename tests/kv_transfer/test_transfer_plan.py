"""Planning: validation, coalescing, message grouping, and the staging copies."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer import PageCopy, PageTable, PeerAddress
from kv_transfer.transfer_plan import (
    MAX_STAGED_BYTES,
    MIN_DIRECT_BYTES,
    gather,
    make_plan,
    scatter,
    split_messages,
)

LENGTHS = {"a": 1 << 22, "b": 1 << 22}


def test_adjacent_pages_coalesce_into_one_run() -> None:
    pages = [PageCopy("a", i * 100, "b", 1000 + i * 100, 100) for i in range(10)]
    plan = make_plan(pages, LENGTHS, LENGTHS)
    assert plan.runs.tolist() == [[0, 0, 0, 1000, 1000]]
    assert plan.num_bytes == 1000


def test_pages_adjacent_on_one_side_only_stay_apart() -> None:
    pages = [PageCopy("a", 0, "b", 0, 100), PageCopy("a", 100, "b", 500, 100)]
    assert len(make_plan(pages, LENGTHS, LENGTHS).runs) == 2


def coalesce_one_by_one(pages: list[PageCopy], names: list[str]) -> list[list[int]]:
    """The reference: walk the pages in order, extending the last run while a page follows it
    on both sides in the same regions."""
    runs: list[list[int]] = []
    for page in pages:
        row = [names.index(page.src_region), page.src_offset, names.index(page.dst_region),
               page.dst_offset, page.length]  # fmt: skip
        last = runs[-1] if runs else None
        if (
            last is not None
            and last[0] == row[0]
            and last[2] == row[2]
            and last[1] + last[4] == row[1]
            and last[3] + last[4] == row[3]
        ):
            last[4] += row[4]
        else:
            runs.append(row)
    return runs


@pytest.mark.parametrize("seed", range(6))
def test_coalescing_equals_merging_page_by_page(seed: int) -> None:
    """Tables that merge nowhere, everywhere and in places, over one or two regions a side."""
    rng = np.random.default_rng(seed)
    num_pages, page = int(rng.integers(1, 400)), 64
    blocks = np.arange(num_pages)
    if seed % 3 == 1:  # pairs of blocks in order, the pairs shuffled: every other page merges
        blocks = (rng.permutation(num_pages // 2 + 1)[:, None] * 2 + [0, 1]).ravel()[:num_pages]
    elif seed % 3 == 2:
        blocks = rng.permutation(num_pages)
    regions = ["a", "b"] if seed >= 3 else ["a"]
    pages = [
        PageCopy(
            regions[i % len(regions)] if seed >= 4 else "a",
            i * page,
            regions[int(b) % len(regions)],
            int(b) * page,
            page,
        )  # fmt: skip
        for i, b in enumerate(blocks)
    ]
    plan = make_plan(pages, LENGTHS, LENGTHS)
    names = sorted({"a", "b"})
    expected = coalesce_one_by_one(pages, names)
    remapped = [
        [names.index(plan.src_regions[r[0]]), r[1], names.index(plan.dst_regions[r[2]]), r[3], r[4]]
        for r in plan.runs.tolist()
    ]
    assert remapped == expected
    assert plan.num_bytes == num_pages * page


def test_large_runs_go_direct_and_small_ones_are_staged() -> None:
    big = MIN_DIRECT_BYTES
    pages = [
        PageCopy("a", 0, "b", 0, 100),
        PageCopy("a", 200, "b", 200, 100),
        PageCopy("a", 1 << 20, "b", 1 << 20, big),
        PageCopy("a", 0, "b", 3 << 20, 50),
    ]
    messages = make_plan(pages, LENGTHS, LENGTHS).messages
    assert [(m.run_start, m.run_end, m.num_bytes, m.is_staged) for m in messages] == [
        (0, 2, 200, True),
        (2, 3, big, False),
        (3, 4, 50, True),
    ]


def test_staged_messages_are_capped() -> None:
    page = 8192
    num_pages = 3 * MAX_STAGED_BYTES // page
    table = PageTable.from_blocks("a", np.arange(num_pages) * 2, "b", np.arange(num_pages), page)
    plan = make_plan(table, {"a": 2 * num_pages * page}, {"b": num_pages * page})
    assert [m.num_bytes for m in plan.messages] == [MAX_STAGED_BYTES] * 3


@pytest.mark.parametrize("uniform", [True, False])
def test_gather_then_scatter_moves_each_page(uniform: bool) -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 1 << 16, np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    lengths = [256] * 32 if uniform else rng.integers(1, 300, 32).tolist()
    src_slots = rng.permutation(64)[:32] * 512
    dst_slots = rng.permutation(64)[:32] * 512
    pages = [
        PageCopy("a", int(s), "b", int(d), int(n))
        for s, d, n in zip(src_slots, dst_slots, lengths, strict=True)
    ]
    plan = make_plan(pages, {"a": src.nbytes}, {"b": dst.nbytes})
    staging = np.empty(plan.num_bytes, np.uint8)
    gather(plan.runs, [src], staging)
    scatter(plan.runs, staging, [dst])
    for p in pages:
        assert np.array_equal(
            dst[p.dst_offset : p.dst_offset + p.length], src[p.src_offset : p.src_offset + p.length]
        )


def test_page_table_from_pages_matches_from_blocks() -> None:
    pages = [PageCopy("a", 8 * s, "b", 8 * d, 8) for s, d in [(3, 1), (0, 7)]]
    assert PageTable.from_pages(pages).table.tolist() == (
        PageTable.from_blocks("a", [3, 0], "b", [1, 7], 8).table.tolist()
    )


def test_page_table_concat_remaps_region_indices() -> None:
    k = PageTable.from_blocks("k", [1], "dk", [2], 8)
    v = PageTable.from_blocks("v", [1], "dv", [2], 8)
    both = PageTable.concat([v, k])
    assert both.src_regions == ["k", "v"] and both.dst_regions == ["dk", "dv"]
    assert both.table[:, [0, 2]].tolist() == [[1, 1], [0, 0]]


def test_no_pages_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one page"):
        make_plan([], LENGTHS, LENGTHS)


def test_peer_address_round_trips_through_bytes() -> None:
    address = PeerAddress("ucx", b"\x00\xffworker", {"kv": 1 << 30})
    assert PeerAddress.from_bytes(address.to_bytes()) == address


def test_the_package_imports_neither_torch_nor_the_project() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kv_transfer, kv_transfer.ucx; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'services', 'prefill_node', 'decode_node', 'gateway')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_regions_are_writable_contiguous_host_memory() -> None:
    from kv_transfer.region import make_region

    assert make_region("m", memoryview(bytearray(10))).length == 10
    assert make_region("f", np.zeros((4, 4), np.float16)).length == 32
    with pytest.raises(ValueError, match="contiguous"):
        make_region("x", np.zeros((4, 4))[:, ::2])
    read_only = np.zeros(4)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        make_region("x", read_only)
    with pytest.raises(TypeError, match="buffer protocol"):
        make_region("x", 5)


def test_contiguous_span_of_one_side() -> None:
    from kv_transfer.transfer_plan import DST, DST_OFF, SRC, SRC_OFF, contiguous_span

    plan = make_plan(PageTable.from_blocks("a", [0, 1, 2], "b", [7, 3, 5], 100), LENGTHS, LENGTHS)
    assert contiguous_span(plan.runs, SRC, SRC_OFF) == (0, 0, 300)
    assert contiguous_span(plan.runs, DST, DST_OFF) is None


def greedy_messages(lengths: list[int]) -> list[tuple[int, int, int, bool]]:
    """The grouping rule one run at a time: a large run alone, small ones added to the open
    message while it stays within MAX_STAGED_BYTES."""
    out, start, staged = [], 0, 0
    for i, length in enumerate(lengths):
        if length >= MIN_DIRECT_BYTES:
            if staged:
                out.append((start, i, staged, True))
            out.append((i, i + 1, length, False))
            start, staged = i + 1, 0
            continue
        if staged + length > MAX_STAGED_BYTES and staged:
            out.append((start, i, staged, True))
            start, staged = i, 0
        staged += length
    if staged:
        out.append((start, len(lengths), staged, True))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_messages_match_the_greedy_rule_on_random_runs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_runs = 1500 if seed == 0 else int(rng.integers(1, 400))
    small = rng.integers(1, MIN_DIRECT_BYTES, num_runs)
    large = rng.integers(MIN_DIRECT_BYTES, 3 * MAX_STAGED_BYTES, num_runs)
    # Mostly small runs, some large, and at seed 0 exact-fit 8 KiB pages (512 to a message).
    lengths = np.where(rng.random(num_runs) < 0.1, large, small)
    if seed == 0:
        lengths[:] = 8192
    runs = np.zeros((num_runs, 5), np.int64)
    runs[:, 4] = lengths
    got = [(m.run_start, m.run_end, m.num_bytes, m.is_staged) for m in split_messages(runs)]
    assert got == greedy_messages(lengths.tolist())


@pytest.mark.parametrize("size", [8192, 3000, 100, MIN_DIRECT_BYTES - 1])
def test_equal_runs_are_grouped_as_the_greedy_rule_groups_them(size: int) -> None:
    """Equal small runs take a shortcut; sizes that do not divide MAX_STAGED_BYTES included."""
    for num_runs in (1, 7, 3 * (MAX_STAGED_BYTES // size) + 1):
        runs = np.zeros((num_runs, 5), np.int64)
        runs[:, 4] = size
        got = [(m.run_start, m.run_end, m.num_bytes, m.is_staged) for m in split_messages(runs)]
        assert got == greedy_messages([size] * num_runs)


@pytest.mark.parametrize("regions", [["a"], ["a", "b"]])
@pytest.mark.parametrize("index", [-1, 2])
def test_a_page_naming_no_region_is_refused(regions: list[str], index: int) -> None:
    table = PageTable.from_blocks("a", [0, 1, 2], "b", [0, 1, 2], 100).table.copy()
    table[1, 0] = index
    pages = PageTable(regions, ["b"], table)
    with pytest.raises(ValueError, match=f"page 1: source region index {index} is not one of"):
        make_plan(pages, LENGTHS, LENGTHS)


def test_a_column_major_table_plans_as_its_row_major_copy() -> None:
    """from_blocks hands over its columns (a column-major table): the same runs, row-major."""
    rng = np.random.default_rng(2)
    src, dst = rng.permutation(200)[:150], rng.permutation(200)[:150]
    src[40:60], dst[40:60] = np.arange(20), np.arange(100, 120)  # a stretch that merges
    pages = PageTable.from_blocks("a", src, "b", dst, 512)
    assert pages.table.flags.f_contiguous
    row_major = PageTable(pages.src_regions, pages.dst_regions, np.ascontiguousarray(pages.table))
    plan, reference = make_plan(pages, LENGTHS, LENGTHS), make_plan(row_major, LENGTHS, LENGTHS)
    assert plan.runs.flags.c_contiguous and np.array_equal(plan.runs, reference.runs)
    assert len(plan.runs) == 150 - 19 and plan.messages == reference.messages
