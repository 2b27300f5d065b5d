"""The libucp calls the UCX transport makes itself (scatter-gather messages ucxx lacks)."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer import ucp_native, ucx
from kv_transfer.transfer_plan import DST, DST_OFF, LEN, SRC, SRC_OFF


def test_iov_table_is_address_and_length_per_run() -> None:
    # runs: (src region, src offset, dst region, dst offset, length)
    runs = np.array([[1, 64, 0, 8, 16], [0, 0, 1, 32, 8]], dtype=np.int64)
    bases = np.array([1000, 5000], dtype=np.int64)
    assert ucp_native.iov_table(bases, runs, SRC, SRC_OFF, LEN).tolist() == [[5064, 16], [1000, 8]]
    assert ucp_native.iov_table(bases, runs, DST, DST_OFF, LEN).tolist() == [[1008, 16], [5032, 8]]


def test_a_request_completed_at_once_has_no_error() -> None:
    request = ucp_native.UcpRequest(None, ())
    assert request.completed
    request.check_error()


def test_an_error_pointer_raises_with_ucx_status_text() -> None:
    # UCS_PTR_STATUS: UCS_ERR_CANCELED (-16) returned in place of a request.
    request = ucp_native.UcpRequest((1 << 64) - 16, ())
    assert request.completed
    with pytest.raises(ucp_native.UcpError, match="[Cc]ancel"):
        request.check_error()


def test_probe_finds_nothing_on_an_idle_worker() -> None:
    transport = ucx.UcxTransport()
    try:
        assert ucp_native.probe(transport._worker.handle) is None
    finally:
        transport.close()
