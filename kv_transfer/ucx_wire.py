"""What the ucx transport puts on the wire: 64-bit tags and the transfer header.

tag = kind (4 bits) | writer slot (24) | transfer sequence number (20) | message index (16).
The slot is random per writer; the receiver keys transfers by (slot, seq) and refuses a header
whose slot another live writer already holds.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kv_transfer.transfer_plan import DST, DST_OFF, LEN, Message

MAX_SEQ = 1 << 20
MAX_MESSAGES = 1 << 16
_LEN = struct.Struct("<I")


class Kind(enum.IntEnum):
    HEADER = 1  # writer → receiver: which messages follow and where they land
    DATA = 2  # writer → receiver: one message of page bytes
    ACK = 3  # receiver → writer: the transfer ended (status code + reason)
    ABORT = 4  # writer → receiver: the transfer was cancelled or timed out
    BYE = 5  # either way: this transport is closing (body: its 16-byte id)
    HELLO = 6  # writer → receiver on connect: its id and worker address, for ACK / BYE
    WELCOME = 7  # receiver → writer: HELLO heard (body: the receiver's id); connect() waits for it


def make_tag(kind: Kind, slot: int, seq: int, index: int = 0) -> int:
    return (int(kind) << 60) | (slot << 36) | (seq << 16) | index


def split_tag(tag: int) -> tuple[Kind, int, int, int]:
    return Kind(tag >> 60), (tag >> 36) & 0xFFFFFF, (tag >> 16) & 0xFFFFF, tag & 0xFFFF


@dataclass(frozen=True)
class Header:
    writer_id: bytes
    # The writer's worker address, for the receiver's ACK / BYE endpoint.
    reply_address: bytes
    transfer_id: str
    slot: int
    seq: int
    # Seconds left until the writer's deadline when it sent the header.
    timeout_s: float
    dst_regions: list[str]
    messages: list[Message]
    # int64 [num_runs, 5], as in TransferPlan.runs.
    runs: np.ndarray

    def encode(self) -> bytes:
        doc = {
            "writer": self.writer_id.hex(),
            "reply": self.reply_address.hex(),
            "tid": self.transfer_id,
            "slot": self.slot,
            "seq": self.seq,
            "timeout_s": self.timeout_s,
            "dst": self.dst_regions,
            "msgs": [
                [m.run_start, m.run_end, m.num_bytes, int(m.is_staged)] for m in self.messages
            ],
        }
        meta = json.dumps(doc, separators=(",", ":")).encode()
        return _LEN.pack(len(meta)) + meta + np.ascontiguousarray(self.runs, np.int64).tobytes()

    def problem(self, region_lengths: Mapping[str, int]) -> str | None:
        """Why the receiver must refuse this header, or None. Its runs become raw addresses in
        the receiver's KV regions (IOV receives), so every page is checked to lie inside its
        region and every message to carry exactly its runs' bytes, before any byte lands."""
        for name in self.dst_regions:
            if name not in region_lengths:
                return f"destination region {name!r} is not registered"
        runs = self.runs
        if not len(runs) or not self.messages:
            return "a transfer without pages"
        limits = np.array([region_lengths[n] for n in self.dst_regions], dtype=np.int64)
        region = runs[:, DST]
        if ((region < 0) | (region >= len(limits))).any():
            return "a page names a destination region the header does not list"
        offset, length = runs[:, DST_OFF], runs[:, LEN]
        if ((offset < 0) | (length <= 0) | (offset + length > limits[region])).any():
            return "a page falls outside its destination region"
        expected_start = 0
        for m in self.messages:
            if m.run_start != expected_start or not m.run_start < m.run_end <= len(runs):
                return "the messages do not cover the pages in order"
            if int(length[m.run_start : m.run_end].sum()) != m.num_bytes:
                return "a message's byte count does not match its pages"
            expected_start = m.run_end
        if expected_start != len(runs):
            return "the messages do not cover the pages in order"
        return None

    @classmethod
    def decode(cls, data: bytes | np.ndarray) -> Header:
        raw = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
        (meta_len,) = _LEN.unpack_from(raw, 0)
        doc = json.loads(bytes(raw[_LEN.size : _LEN.size + meta_len]))
        runs = np.frombuffer(raw[_LEN.size + meta_len :], dtype=np.int64).reshape(-1, 5).copy()
        return cls(
            writer_id=bytes.fromhex(doc["writer"]),
            reply_address=bytes.fromhex(doc["reply"]),
            transfer_id=doc["tid"],
            slot=doc["slot"],
            seq=doc["seq"],
            timeout_s=doc["timeout_s"],
            dst_regions=doc["dst"],
            messages=[Message(a, b, n, bool(s)) for a, b, n, s in doc["msgs"]],
            runs=runs,
        )
