"""The native scatter-gather copy (kv_transfer/csrc/copy_runs.cpp): byte-exact against a
one-run-at-a-time reference on random scattered tables, and every bad list refused with a
ValueError before a single byte moves (never a stray write or a segfault)."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer import shared_memory
from kv_transfer.native_copy import copy_runs_native, native_copy_error
from kv_transfer.transfer_plan import LEN, coalesce

pytestmark = pytest.mark.skipif(
    native_copy_error() is not None, reason=f"native copy unavailable: {native_copy_error()}"
)


def reference(runs: np.ndarray, srcs: list[np.ndarray], dsts: list[np.ndarray]) -> list[np.ndarray]:
    """What copying the runs one after another, in order, leaves in copies of `dsts`."""
    out = [d.copy() for d in dsts]
    for s, s_off, d, d_off, length in runs.tolist():
        out[d][d_off : d_off + length] = srcs[s][s_off : s_off + length]
    return out


def bases(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array([a.ctypes.data for a in arrays], np.int64),
        np.array([a.nbytes for a in arrays], np.int64),
    )


def scattered_runs(
    rng: np.random.Generator, num_pages: int, page: int, src_slots: int, dst_slots: int
) -> np.ndarray:
    """Whole pages at random distinct slots on both sides, over two regions per side."""
    runs = np.empty((num_pages, 5), np.int64)
    runs[:, 0] = rng.integers(0, 2, num_pages)
    runs[:, 1] = rng.choice(src_slots, num_pages, replace=False) * page
    runs[:, 2] = rng.integers(0, 2, num_pages)
    runs[:, 3] = rng.choice(dst_slots, num_pages, replace=False) * page
    runs[:, LEN] = page
    return runs


@pytest.mark.parametrize("page", [8192, 4096 + 24, 100, 1])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_scattered_tables_land_like_the_reference(page: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, 300 * page + 7, np.uint8) for _ in range(2)]
    # Destinations in shared memory, as the shm transport writes them; odd sizes and offsets
    # exercise the unaligned head and tail of the streaming stores.
    dsts = [shared_memory.allocate(260 * page + 3) for _ in range(2)]
    runs = scattered_runs(rng, 200, page, 300, 260)
    runs[::7, 1] += 3  # misaligned sources
    runs[::5, LEN] -= min(page - 1, 5)  # short pages
    expected = reference(runs, srcs, dsts)
    copy_runs_native(runs, *bases(srcs), *bases(dsts))
    for got, want in zip(dsts, expected, strict=True):
        assert np.array_equal(got, want)


def test_runs_that_follow_on_are_merged_and_still_exact() -> None:
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, 1 << 20, np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    # 64 pages of 8 KiB, in order on both sides in stretches of 4: the copy merges each stretch.
    starts = rng.choice(32, 16, replace=False) * 4
    blocks = (starts[:, None] + np.arange(4)).reshape(-1)
    runs = np.stack(
        [np.zeros(64), blocks * 8192, np.zeros(64), blocks[::-1] * 8192, np.full(64, 8192)], 1
    ).astype(np.int64)
    expected = reference(runs, [src], [dst])[0]
    copy_runs_native(coalesce(runs), *bases([src]), *bases([dst]))
    assert np.array_equal(dst, expected)


def test_an_empty_list_copies_nothing() -> None:
    src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    copy_runs_native(np.empty((0, 5), np.int64), *bases([src]), *bases([dst]))
    assert not dst.any()


def test_overlapping_destinations_end_as_if_copied_in_order() -> None:
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 64 << 10, np.uint8)
    dst = np.zeros(64 << 10, np.uint8)
    runs = np.array(
        [[0, 0, 0, 1000, 16384], [0, 20000, 0, 9000, 16384], [0, 40000, 0, 1000, 5000]], np.int64
    )
    expected = reference(runs, [src], [dst])[0]
    copy_runs_native(runs, *bases([src]), *bases([dst]))
    assert np.array_equal(dst, expected)


def test_source_and_destination_in_the_same_memory_copy_as_memmove() -> None:
    rng = np.random.default_rng(4)
    buffer = rng.integers(0, 256, 64 << 10, np.uint8)
    # Each run overlaps itself (shifted by 100 bytes one way, then the other).
    runs = np.array([[0, 0, 0, 100, 20000], [0, 30100, 0, 30000, 20000]], np.int64)
    expected = buffer.copy()
    for _, s_off, _, d_off, length in runs.tolist():
        expected[d_off : d_off + length] = expected[s_off : s_off + length].copy()
    copy_runs_native(runs, *bases([buffer]), *bases([buffer]))
    assert np.array_equal(buffer, expected)


@pytest.mark.parametrize(
    ("bad_run", "what"),
    [
        ([0, 4096, 0, 0, 8192], "source past the end"),
        ([0, 0, 0, 4096, 8192], "destination past the end"),
        ([0, -8, 0, 0, 8], "negative source offset"),
        ([0, 0, 0, -8, 8], "negative destination offset"),
        ([0, 0, 0, 0, 0], "empty"),
        ([0, 0, 0, 0, -5], "negative length"),
        ([1, 0, 0, 0, 8], "source region that does not exist"),
        ([0, 0, -1, 0, 8], "negative destination region"),
        ([0, 2**62, 0, 0, 2**62], "offset + length overflowing int64"),
    ],
)
def test_a_bad_run_is_refused_before_any_byte_moves(bad_run: list[int], what: str) -> None:
    src = np.full(8192, 7, np.uint8)
    dst = np.zeros(8192, np.uint8)
    good = [0, 0, 0, 0, 4096]
    runs = np.array([good, bad_run], np.int64)
    with pytest.raises(ValueError, match=r"run 1: .* outside its regions"):
        copy_runs_native(runs, *bases([src]), *bases([dst]))
    assert not dst.any(), f"{what}: the good run before it must not have been copied"


def test_malformed_arrays_are_refused_naming_the_shape() -> None:
    src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match=r"runs must be int64 \[num_runs, 5\]"):
        copy_runs_native(np.zeros((2, 3), np.int64), *bases([src]), *bases([dst]))
    with pytest.raises(ValueError, match="destination bases and lengths"):
        copy_runs_native(
            np.zeros((1, 5), np.int64), *bases([src]), np.array([dst.ctypes.data]), np.array([])
        )
    with pytest.raises(ValueError, match="source region lengths must not be negative"):
        copy_runs_native(
            np.zeros((1, 5), np.int64), np.array([src.ctypes.data]), np.array([-1]), *bases([dst])
        )


def test_every_native_source_ships_in_the_package() -> None:
    """An installed package (the node images) must carry the C++ it compiles on first use."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    shipped = {
        path
        for package, patterns in package_data.items()
        for pattern in patterns
        for path in (root / package.replace(".", "/")).glob(pattern)
    }
    packages = [d for d in root.iterdir() if (d / "__init__.py").exists()]
    sources = {
        p for d in packages for pattern in ("**/csrc/*.cpp", "**/csrc/*.h") for p in d.glob(pattern)
    }
    assert sources and sources <= shipped, sorted(str(p) for p in sources - shipped)
