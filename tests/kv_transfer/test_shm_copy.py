"""The shm writer's copy paths: uniform KV pages (in order at the source, or scattered on both
sides) and arbitrary runs, each landing byte-exact, through the native copy and through the numpy
fallback (bounce buffer) alike."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer import PageTable, make_transport, shared_memory
from kv_transfer.native_copy import native_copy_error
from kv_transfer.self_test import run_self_test
from kv_transfer.shm import BOUNCE_PAGES, ShmTransport, copy_runs, copy_runs_numpy
from kv_transfer.transfer_plan import MAX_STAGED_BYTES, make_plan

PAGE = 8192
SLOTS = 256


@pytest.mark.parametrize("path", ["native", "numpy"])
@pytest.mark.parametrize("layout", ["src-in-order", "both-scattered", "mixed-lengths"])
def test_copy_runs_lands_every_page(layout: str, path: str) -> None:
    if path == "native" and native_copy_error() is not None:
        pytest.skip(f"native copy unavailable: {native_copy_error()}")
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, SLOTS * PAGE, np.uint8)
    dst = shared_memory.allocate(SLOTS * PAGE)
    n = 3 * BOUNCE_PAGES + 5  # a partial last bounce
    dst_blocks = rng.choice(SLOTS, n, replace=False)
    src_blocks = np.arange(n) if layout == "src-in-order" else rng.choice(SLOTS, n, replace=False)
    pages = PageTable.from_blocks("s", src_blocks, "d", dst_blocks, PAGE)
    if layout == "mixed-lengths":
        pages.table[::3, 4] = 100  # not uniform: the per-run path
    plan = make_plan(pages, {"s": src.nbytes}, {"d": dst.nbytes})
    bases = np.array([src.ctypes.data]), np.array([dst.ctypes.data])
    lengths = np.array([src.nbytes]), np.array([dst.nbytes])
    for m in plan.messages:
        runs = plan.runs[m.run_start : m.run_end]
        if path == "native":
            copy_runs(runs, *bases, *lengths)
        else:
            copy_runs_numpy(runs, *bases)
    expected = np.zeros_like(dst)
    for s, d, length in pages.table[:, [1, 3, 4]].tolist():
        expected[d : d + length] = src[s : s + length]
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize("native", [True, False])
def test_self_test_names_the_copy_path_and_lands_every_page(native: bool) -> None:
    if native and native_copy_error() is not None:
        pytest.skip(f"native copy unavailable: {native_copy_error()}")
    transport = make_transport("shm", native_copy=native)
    try:
        report = run_self_test(transport, num_probe_bytes=1 << 20)
    finally:
        transport.close()
    assert report.is_ok, report.error
    assert report.lanes[0].startswith("memfd/native-copy" if native else "memfd/numpy-copy")


def test_a_push_of_at_most_one_message_is_one_batch() -> None:
    """Up to MAX_STAGED_BYTES in all, one hold of the slot mutex copies every run (a fence then
    waits for no more than a message's worth); more, one batch per message."""
    rng = np.random.default_rng(5)
    slots = 3 * MAX_STAGED_BYTES // PAGE
    lengths = {"s": slots * PAGE}, {"d": slots * PAGE}
    for num_pages in (1, MAX_STAGED_BYTES // PAGE, MAX_STAGED_BYTES // PAGE + 1, slots):
        pages = PageTable.from_blocks(
            "s", rng.permutation(slots)[:num_pages], "d", rng.permutation(slots)[:num_pages], PAGE
        )
        plan = make_plan(pages, *lengths)
        batches = ShmTransport._batches(None, plan)  # type: ignore[arg-type]
        assert np.array_equal(np.concatenate([runs for runs, _ in batches]), plan.runs)
        assert [n for _, n in batches] == [int(runs[:, 4].sum()) for runs, _ in batches]
        expected = 1 if plan.num_bytes <= MAX_STAGED_BYTES else len(plan.messages)
        assert len(batches) == expected and all(n <= MAX_STAGED_BYTES for _, n in batches)
