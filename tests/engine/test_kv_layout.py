"""KvLayout: fingerprints and the page copies between two nodes' caches, one object per copy
(``layer_copies``) and as the push's page table (``kv_page_table``)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from kv_transfer import PageCopy, PageTable
from kv_transfer.transfer_plan import make_plan
from services.engine.kv_layout import KvLayout, LayerCopy, layer_copies, layer_copy_table
from services.node.kv_regions import kv_page_table, region_name


def layout(**changes) -> KvLayout:
    base = KvLayout(
        model_id="LlamaForCausalLM:abc",
        dtype="bfloat16",
        block_size=16,
        num_layers=2,
        num_kv_heads=4,
        head_dim=64,
        num_blocks=100,
    )
    return dataclasses.replace(base, **changes)


def test_fingerprint_ignores_only_the_cache_size() -> None:
    assert layout().fingerprint == layout(num_blocks=7).fingerprint
    for change in (
        {"model_id": "Qwen3ForCausalLM:abc"},
        {"dtype": "float32"},
        {"block_size": 32},
        {"num_layers": 3},
        {"num_kv_heads": 8},
        {"head_dim": 128},
    ):
        assert layout(**change).fingerprint != layout().fingerprint, change


def test_block_bytes_and_offsets() -> None:
    lay = layout()
    assert lay.block_bytes == 16 * 4 * 64 * 2
    assert lay.key_offset(3) == 3 * lay.block_bytes
    assert lay.value_offset(3) == 103 * lay.block_bytes
    assert lay.layer_bytes == 200 * lay.block_bytes


def test_runs_of_consecutive_blocks_on_both_sides_are_merged() -> None:
    src, dst = layout(num_blocks=100), layout(num_blocks=50)
    size = src.block_bytes
    copies = layer_copies(src, [4, 5, 6, 9], dst, [10, 11, 30, 31])
    # runs: (4->10, 2 blocks), (6->30, 1 block: 6->7 is consecutive but 11->30 is not), (9->31, 1)
    layer0 = [c for c in copies if c.layer == 0]
    assert layer0 == [
        LayerCopy(0, 4 * size, 10 * size, 2 * size),
        LayerCopy(0, 104 * size, 60 * size, 2 * size),
        LayerCopy(0, 6 * size, 30 * size, size),
        LayerCopy(0, 106 * size, 80 * size, size),
        LayerCopy(0, 9 * size, 31 * size, size),
        LayerCopy(0, 109 * size, 81 * size, size),
    ]
    assert len(copies) == 2 * len(layer0)
    assert sum(c.length for c in copies) == 2 * 2 * 4 * size  # layers x (K, V) x blocks


def test_bad_copies_are_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        layer_copies(layout(), [100], layout(), [0])
    with pytest.raises(ValueError, match="destination block ids"):
        layer_copies(layout(), [0], layout(num_blocks=5), [5])
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        layer_copies(layout(), [0, 1], layout(), [0])
    with pytest.raises(ValueError, match="unknown KV dtype"):
        layout(dtype="int8")


def reference_page_table(
    src: KvLayout, src_ids: list[int], dst: KvLayout, dst_ids: list[int]
) -> PageTable:
    """The push's pages as they were built before `kv_page_table`: one object per copy."""
    pages = [
        PageCopy(region_name(c.layer), c.src_offset, region_name(c.layer), c.dst_offset, c.length)
        for c in layer_copies(src, src_ids, dst, dst_ids)
    ]
    return PageTable.from_pages(pages)


def named_rows(pages: PageTable) -> list[tuple[str, int, str, int, int]]:
    """The table's rows with region indices resolved to names, which two tables may order
    differently (from_pages sorts them: kv.layer10 before kv.layer2)."""
    return [
        (pages.src_regions[s], src_off, pages.dst_regions[d], dst_off, length)
        for s, src_off, d, dst_off, length in pages.table.tolist()
    ]


def pairings(rng: random.Random, num_blocks: int) -> dict[str, tuple[list[int], list[int]]]:
    """Block id pairings of ``num_blocks`` blocks, in a source cache of 300 blocks and a
    destination cache of 200: scattered, consecutive, consecutive on one side only, and runs of
    random lengths on both sides that sometimes break on one side only."""
    src_scattered = rng.sample(range(300), num_blocks)
    dst_scattered = rng.sample(range(200), num_blocks)
    src_runs, dst_runs = [rng.randrange(300)], [rng.randrange(200)]
    while len(src_runs) < num_blocks:
        follows = rng.random() < 0.7
        src_runs.append(src_runs[-1] + 1 if follows else rng.randrange(300))
        dst_runs.append(dst_runs[-1] + 1 if follows or rng.random() < 0.3 else rng.randrange(200))
    # Wrapped into range: a run may break at the end of a cache.
    src_runs, dst_runs = [b % 300 for b in src_runs], [b % 200 for b in dst_runs]
    start = rng.randrange(200 - num_blocks)
    return {
        "scattered": (src_scattered, dst_scattered),
        "consecutive": (list(range(7, 7 + num_blocks)), list(range(start, start + num_blocks))),
        "consecutive source only": (list(range(num_blocks)), dst_scattered),
        "runs": (src_runs, dst_runs),
    }


@pytest.mark.parametrize("num_layers", [1, 2, 12, 16])
@pytest.mark.parametrize(
    "shape", [{}, {"dtype": "float32", "block_size": 8}, {"num_kv_heads": 1, "head_dim": 128}]
)
@pytest.mark.parametrize("seed", range(3))
def test_page_table_equals_the_page_by_page_path(num_layers: int, shape: dict, seed: int) -> None:
    rng = random.Random(seed)
    src = layout(num_layers=num_layers, num_blocks=300, **shape)
    dst = layout(num_layers=num_layers, num_blocks=200, **shape)
    for num_blocks in (1, 2, rng.randrange(3, 130)):
        for kind, (src_ids, dst_ids) in pairings(rng, num_blocks).items():
            pages = kv_page_table(src, src_ids, dst, dst_ids)
            expected = reference_page_table(src, src_ids, dst, dst_ids)
            assert pages.table.dtype == np.int64
            assert named_rows(pages) == named_rows(expected), (kind, num_blocks)
            rows = layer_copy_table(src, src_ids, dst, dst_ids).tolist()
            copies = layer_copies(src, src_ids, dst, dst_ids)
            assert rows == [[c.layer, c.src_offset, c.dst_offset, c.length] for c in copies]
            # Each row's region index is its layer, on both sides.
            assert pages.src_regions == pages.dst_regions
            assert pages.src_regions == [region_name(i) for i in range(num_layers)]


def test_a_page_table_is_planned_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = layout(num_layers=12, num_blocks=300), layout(num_layers=12, num_blocks=200)
    src_ids, dst_ids = [4, 5, 6, 9, 250], [10, 11, 30, 31, 199]
    expected = make_plan(
        reference_page_table(src, src_ids, dst, dst_ids),
        {region_name(i): src.layer_bytes for i in range(12)},
        {region_name(i): dst.layer_bytes for i in range(12)},
    )

    def no_pages(pages: object) -> PageTable:
        raise AssertionError("make_plan rebuilt a PageTable it was given")

    monkeypatch.setattr(PageTable, "from_pages", no_pages)
    plan = make_plan(
        kv_page_table(src, src_ids, dst, dst_ids),
        {region_name(i): src.layer_bytes for i in range(12)},
        {region_name(i): dst.layer_bytes for i in range(12)},
    )
    as_plan = PageTable(plan.src_regions, plan.dst_regions, plan.runs)
    as_expected = PageTable(expected.src_regions, expected.dst_regions, expected.runs)
    assert named_rows(as_plan) == named_rows(as_expected)


@pytest.mark.parametrize(
    ("src", "src_ids", "dst", "dst_ids"),
    [
        (layout(), [0], layout(dtype="float32"), [0]),
        (layout(), [0, 1], layout(), [0]),
        (layout(), [100], layout(), [0]),
        (layout(), [-1, 2, 100, 101, 102, 103], layout(), [0, 1, 2, 3, 4, 5]),
        (layout(), [0], layout(num_blocks=5), [5]),
    ],
)
def test_the_table_refuses_what_layer_copies_refuses(
    src: KvLayout, src_ids: list[int], dst: KvLayout, dst_ids: list[int]
) -> None:
    with pytest.raises(ValueError) as expected:
        layer_copies(src, src_ids, dst, dst_ids)
    with pytest.raises(ValueError) as table:
        layer_copy_table(src, src_ids, dst, dst_ids)
    with pytest.raises(ValueError) as pages:
        kv_page_table(src, src_ids, dst, dst_ids)
    assert str(table.value) == str(pages.value) == str(expected.value)


def test_no_blocks_is_an_empty_table() -> None:
    assert layer_copy_table(layout(), [], layout(), []).shape == (0, 4)
    assert len(kv_page_table(layout(), [], layout(), [])) == 0
