"""The block placement benchmark's counting, and its chat traffic through the real scheduler."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from block_placement import BLOCK_SIZE, adjacency, simulate_chat  # noqa: E402


def test_adjacency_counts_consecutive_ids_within_each_table() -> None:
    # 3->4, 4->5 adjacent; 5->9 not; [7] has no pair; 1->0 runs backwards.
    assert adjacency([[3, 4, 5, 9], [7], [1, 0]]) == (2, 4)
    assert adjacency([]) == (0, 0)


def test_chat_traffic_hits_the_prefix_cache_and_keeps_tables_in_rows() -> None:
    args = argparse.Namespace(
        num_blocks=300, max_num_seqs=8, steps=1000, num_conversations=120, seed=0
    )

    hit_rate, adjacent, tables, lens = simulate_chat(args)

    assert 0.2 < hit_rate < 1  # the system prompts and earlier turns are shared
    # 0.78 here; a free queue in LRU order gives 0.50 on this traffic (and less the longer it
    # runs): the blocks of a growing sequence are handed out in a row.
    assert adjacent > 0.65
    assert tables and len(tables) == len(lens)
    for table, num_tokens in zip(tables, lens, strict=True):
        assert len(table) >= -(-num_tokens // BLOCK_SIZE)
        assert all(0 <= block_id < args.num_blocks for block_id in table)
