"""The standalone KV byte mover: transports (loopback, ucx, shm, cuda_ipc) that copy KV pages
from a prefill node's blocks into a decode node's reserved blocks.

It imports nothing from the rest of pdserve (nor torch), so either role can use it and it can be
tested alone. `kv_transfer.ucx`, `.shm` and `.cuda_ipc` are imported on first use of
`make_transport(name)`, so code that only needs loopback loads neither UCX nor CuPy.
"""

from kv_transfer.inbound import InboundTransfers
from kv_transfer.loopback import LoopbackFaults, LoopbackTransport
from kv_transfer.page_copy import PageCopy
from kv_transfer.page_table import PageTable
from kv_transfer.peer_address import PeerAddress
from kv_transfer.region import RegionHandle
from kv_transfer.self_test import SelfTestReport, run_self_test
from kv_transfer.transfer_handle import TransferHandle
from kv_transfer.transfer_status import TransferStatus
from kv_transfer.transport import (
    KvTransport,
    TransportInfo,
    available_transports,
    make_transport,
    register_transport,
)

__all__ = [
    "InboundTransfers",
    "KvTransport",
    "LoopbackFaults",
    "LoopbackTransport",
    "PageCopy",
    "PageTable",
    "PeerAddress",
    "RegionHandle",
    "SelfTestReport",
    "TransferHandle",
    "TransferStatus",
    "TransportInfo",
    "available_transports",
    "make_transport",
    "register_transport",
    "run_self_test",
]
