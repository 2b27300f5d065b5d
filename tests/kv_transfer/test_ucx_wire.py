"""The UCX wire header: it round-trips, and the receiver refuses one that would write outside
its KV regions (its runs become raw addresses of IOV receives)."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer.page_copy import PageCopy
from kv_transfer.transfer_plan import DST, DST_OFF, LEN, Message, make_plan
from kv_transfer.ucx_wire import Header

PAGE = 4096
REGIONS = {"k": 16 * PAGE, "v": 16 * PAGE}


def header(pages: list[PageCopy]) -> Header:
    plan = make_plan(pages, {"src": 64 * PAGE}, REGIONS)
    return Header(
        writer_id=b"w" * 16, reply_address=b"addr", transfer_id="t", slot=7, seq=3,
        timeout_s=5.0, dst_regions=plan.dst_regions, messages=plan.messages, runs=plan.runs,
    )  # fmt: skip


@pytest.fixture
def good() -> Header:
    return header(
        [
            PageCopy("src", 3 * PAGE, "k", 9 * PAGE, PAGE),
            PageCopy("src", 40 * PAGE, "v", 2 * PAGE, PAGE),
            PageCopy("src", 7 * PAGE, "k", 15 * PAGE, PAGE),
        ]
    )


def with_runs(h: Header, runs: np.ndarray) -> Header:
    return Header(**{**h.__dict__, "runs": runs})


def test_round_trip_and_a_valid_header_passes(good: Header) -> None:
    decoded = Header.decode(good.encode())
    assert decoded.messages == good.messages and np.array_equal(decoded.runs, good.runs)
    assert decoded.problem(REGIONS) is None


@pytest.mark.parametrize(
    "column, value, reason",
    [
        (DST_OFF, -PAGE, "outside its destination region"),  # before the region
        (DST_OFF, 16 * PAGE, "outside its destination region"),  # past its end
        (LEN, 0, "outside its destination region"),
        (DST, 5, "does not list"),
        (DST, -1, "does not list"),
    ],
)
def test_a_page_outside_the_regions_is_refused(
    good: Header, column: int, value: int, reason: str
) -> None:
    runs = good.runs.copy()
    runs[0, column] = value
    assert reason in with_runs(good, runs).problem(REGIONS)


def test_messages_must_carry_exactly_their_pages(good: Header) -> None:
    total = int(good.runs[:, LEN].sum())
    n = len(good.runs)
    wrong_bytes = Header(**{**good.__dict__, "messages": [Message(0, n, total + 1, True)]})
    assert "byte count" in wrong_bytes.problem(REGIONS)
    gap = Header(**{**good.__dict__, "messages": [Message(1, n, total - PAGE, True)]})
    assert "in order" in gap.problem(REGIONS)
    short = Header(**{**good.__dict__, "messages": [Message(0, n - 1, total - PAGE, True)]})
    assert "in order" in short.problem(REGIONS)


def test_an_unregistered_region_is_refused(good: Header) -> None:
    assert "not registered" in good.problem({"k": 16 * PAGE})
