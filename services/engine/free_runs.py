"""The free blocks of a ``BlockPool`` that hold no cached prefix, kept as maximal runs of
consecutive block ids, so that a sequence's blocks can be handed out next to each other.

Why: decode attention reads every block of every sequence each step, and the CPU kernel reads a
sequence's blocks faster when they lie in a row (AMD EPYC host, 64 sequences x 320 tokens, 12
layers: 0.92-0.96 ms a layer call in a row, 1.33-1.39 ms scattered; ``benchmarks/
attention_kernels.py --contiguous-blocks``). A free queue in LRU order scatters them once
the pool has turned over; runs keep a growing sequence's blocks together (``benchmarks/
block_placement.py``).

Life cycle of a run:

1. ``add``    a block becomes free and uncached: it joins the run ending just before it and the
              run starting just after it (at most one of each), so runs are always maximal.
2. ``take``   blocks are handed out from a run (``take_after``: from the run that starts right
              after a sequence's last block, so that the sequence grows in place; ``take``: from
              the middle of the largest run, so that the new sequence has room to grow and so
              has the one before it). What remains of the run, before and after, stays free.

The largest run is found through a heap of ``(-length, start)`` entries, one pushed for every
run formed; an entry whose run has since changed is dropped when it reaches the top, and the
heap is rebuilt when such entries outnumber the runs.
"""

from __future__ import annotations

import heapq


class FreeRuns:
    """Free block ids as maximal runs ``[start, end)``; ``num_blocks`` of them in all."""

    def __init__(self, num_blocks: int) -> None:
        self._end_of: dict[int, int] = {}
        """start -> end (exclusive) of each run."""
        self._start_of: dict[int, int] = {}
        """end -> start of each run."""
        self._by_length: list[tuple[int, int]] = []
        self.num_blocks = 0
        """Blocks in all runs together."""
        if num_blocks:
            self._insert(0, num_blocks)
            self.num_blocks = num_blocks

    def runs(self) -> list[tuple[int, int]]:
        """(start, end) of every run, in id order."""
        return sorted(self._end_of.items())

    @property
    def max_run_length(self) -> int:
        """The length of the largest run (0 when none is free)."""
        if not self._end_of:
            return 0
        start, end = self._largest()
        return end - start

    def add(self, block_id: int) -> None:
        """Make ``block_id`` free, merging it with the runs on either side."""
        # Not the first or the last block of a run (a block inside one is the pool's to catch).
        assert block_id not in self._end_of and block_id + 1 not in self._start_of, block_id
        start, end = block_id, block_id + 1
        left = self._start_of.pop(block_id, None)
        if left is not None:
            del self._end_of[left]
            start = left
        right = self._end_of.pop(block_id + 1, None)
        if right is not None:
            del self._start_of[right]
            end = right
        self._insert(start, end)
        self.num_blocks += 1

    def take_after(self, block_id: int, max_blocks: int) -> list[int]:
        """Up to ``max_blocks`` ids from ``block_id + 1`` on, as far as they are free."""
        start = block_id + 1
        end = self._end_of.get(start)
        if end is None or max_blocks <= 0:
            return []
        num_taken = min(max_blocks, end - start)
        self._cut(start, start, num_taken)
        return list(range(start, start + num_taken))

    def take(self, num_blocks: int) -> list[int]:
        """``num_blocks`` ids, in a row where one run holds them all: the middle of the largest
        run (its start when it begins at block 0, where no sequence can grow into it). Where
        none is that long, whole runs, largest first."""
        assert num_blocks <= self.num_blocks, (num_blocks, self.num_blocks)
        taken: list[int] = []
        while len(taken) < num_blocks:
            start, end = self._largest()
            wanted = num_blocks - len(taken)
            if end - start > wanted:
                first = start if start == 0 else start + (end - start - wanted) // 2
                self._cut(start, first, wanted)
                taken.extend(range(first, first + wanted))
            else:
                self._cut(start, start, end - start)
                taken.extend(range(start, end))
        return taken

    def _largest(self) -> tuple[int, int]:
        while True:
            negative_length, start = self._by_length[0]
            end = self._end_of.get(start)
            if end is not None and end - start == -negative_length:
                return start, end
            heapq.heappop(self._by_length)

    def _insert(self, start: int, end: int) -> None:
        self._end_of[start] = end
        self._start_of[end] = start
        heapq.heappush(self._by_length, (start - end, start))
        if len(self._by_length) > 2 * len(self._end_of) + 64:
            self._by_length = [(s - e, s) for s, e in self._end_of.items()]
            heapq.heapify(self._by_length)

    def _cut(self, start: int, first: int, num_taken: int) -> None:
        """Remove ids [first, first + num_taken) from the run that starts at ``start``."""
        end = self._end_of.pop(start)
        del self._start_of[end]
        assert start <= first and first + num_taken <= end, (start, end, first, num_taken)
        if first > start:
            self._insert(start, first)
        if first + num_taken < end:
            self._insert(first + num_taken, end)
        self.num_blocks -= num_taken
