"""The shm writer's copy paths: uniform KV pages (in order at the source, or scattered on both
sides) and arbitrary runs, each landing byte-exact, through the native copy and through the numpy
fallback (bounce buffer) alike."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer import PageTable, make_transport, shared_memory
from kv_transfer.native_copy import native_copy_error
from kv_transfer.self_test import run_self_test
from kv_transfer.shm import BOUNCE_PAGES, copy_runs, copy_runs_numpy
from kv_transfer.transfer_plan import make_plan

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
