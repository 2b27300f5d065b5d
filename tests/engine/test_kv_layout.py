"""KvLayout: fingerprints and the page copies between two nodes' caches."""

from __future__ import annotations

import dataclasses

import pytest

from services.engine.kv_layout import KvLayout, LayerCopy, layer_copies


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
