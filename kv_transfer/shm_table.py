"""The receiver's transfer records in shared memory: the shm (and cuda_ipc) fence.

With the shm transport the writer copies straight into the receiver's blocks, so the receiver
runs no code while bytes land. Its `InboundTransfers` records therefore live in a shared control
region that both sides map, and the writer updates them itself. Layout (all words uint64):

    header (4 KiB): table mutex | magic | is_closed | num_slots | next tombstone | owner pid
    slots [NUM_SLOTS x 512 B]: slot mutex | generation | state | is_fenced | bytes received |
                               writer pid | id digest | id length | id (128 B) | error (256 B)
    tombstones [MAX_TOMBSTONES]: digests of forgotten transfer ids (a ring)

Both mutexes are robust, process-shared pthread mutexes (`robust_mutex`): a holder killed with
SIGKILL hands the lock on instead of wedging it.

The protocol (design §3, "shm fence"):

- `claim` (writer, table mutex): refuses a tombstoned, known or fenced id, else takes a free slot,
  bumps its *generation* and marks it IN_PROGRESS. The writer keeps (slot, generation). It
  asks its `TombstoneIndex` of the ring, caught up with the entries added since its last claim,
  rather than comparing all MAX_TOMBSTONES of them (512 KiB) each time.
- Each copy (writer): lock the slot mutex; go on only if the generation is still the writer's,
  the slot is not fenced and still IN_PROGRESS; copy; add the bytes; unlock. "Inside a copy"
  is exactly "holding the slot mutex".
- `fence` (receiver): set is_fenced (and CANCELLED if not terminal) under the table mutex, then
  take and release the slot mutex: every copy that began before the flag was visible has ended,
  and every later one sees the flag and lands nothing. A writer that died mid-copy hands the
  mutex over (EOWNERDEAD): nothing of it can land any more either.
- `forget` (receiver): only when terminal and no copy holds the slot mutex; the id goes to the
  tombstones and the generation is bumped under the slot mutex, so a stale writer holding an old
  (slot, generation) can never write into a slot reused for another transfer.
- A writer whose process died leaves its slot IN_PROGRESS; the receiver reads the writer pid and
  reports FAILED ("the writer process died") so the decode node need not wait for the lease.
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np

from kv_transfer import robust_mutex
from kv_transfer.inbound import MAX_TOMBSTONES, InboundTransfers
from kv_transfer.robust_mutex import Locked
from kv_transfer.shared_memory import is_alive
from kv_transfer.transfer_status import TransferStatus

MAGIC = 0x70647365_72766B76  # "pdservkv"
HEADER_BYTES = 4096
SLOT_BYTES = 512
# Transfers the receiver tracks at once (running, or ended and not yet forgotten). The decode
# node forgets each one when it commits or frees it; it never holds more than max_num_seqs.
NUM_SLOTS = 4096
MAX_ID_BYTES = 128
MAX_ERROR_BYTES = 256
CONTROL_BYTES = HEADER_BYTES + NUM_SLOTS * SLOT_BYTES + MAX_TOMBSTONES * 8

# Header words (uint64 index).
_H_MAGIC, _H_CLOSED, _H_NUM_SLOTS, _H_NEXT_TOMB, _H_OWNER = 8, 9, 10, 11, 12
# Slot words (uint64 index within a slot; the mutex takes words 0-7).
_S_GEN, _S_STATE, _S_FENCED, _S_BYTES, _S_WRITER, _S_DIGEST, _S_ID_LEN, _S_ERR_LEN = range(8, 16)
_ID_AT, _ERR_AT = 128, 256  # byte offsets within a slot

_FREE = 0
_STATUSES = list(TransferStatus)  # state word = index + 1


def _digest(transfer_id: str) -> int:
    value = int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "little")
    return value or 1  # 0 marks an empty tombstone


class ShmTable(InboundTransfers):
    """`InboundTransfers` over a control region: the receiver's own mapping (``owner=True``
    formats it) or a writer's mapping of its peer's."""

    def __init__(self, control: np.ndarray, *, owner: bool) -> None:
        if control.nbytes < CONTROL_BYTES:
            raise ValueError(f"a control region needs {CONTROL_BYTES} bytes, not {control.nbytes}")
        super().__init__()  # unused: the records live in `control`
        self._bytes = control
        self._base: int = control.__array_interface__["data"][0]
        self._words = control[: HEADER_BYTES + NUM_SLOTS * SLOT_BYTES].view(np.uint64)
        self._slots = (
            control[HEADER_BYTES : HEADER_BYTES + NUM_SLOTS * SLOT_BYTES]
            .view(np.uint64)
            .reshape(NUM_SLOTS, SLOT_BYTES // 8)
        )
        tomb_at = HEADER_BYTES + NUM_SLOTS * SLOT_BYTES
        self._tombs = control[tomb_at : tomb_at + MAX_TOMBSTONES * 8].view(np.uint64)
        self._tomb_index = TombstoneIndex(MAX_TOMBSTONES)  # a writer's, for `claim`
        if owner:
            control[:CONTROL_BYTES] = 0
            robust_mutex.init_mutex(self._base)
            for slot in range(NUM_SLOTS):
                robust_mutex.init_mutex(self._slot_mutex(slot))
            self._words[_H_NUM_SLOTS] = NUM_SLOTS
            self._words[_H_OWNER] = os.getpid()
            self._words[_H_MAGIC] = MAGIC
        elif int(self._words[_H_MAGIC]) != MAGIC:
            raise ConnectionError("the peer's control region is not a pdserve shm table")

    # Both sides.

    @property
    def is_closed(self) -> bool:
        return bool(self._words[_H_CLOSED])

    @property
    def owner_pid(self) -> int:
        return int(self._words[_H_OWNER])

    def status(self, transfer_id: str) -> TransferStatus | None:
        slot = self._find(transfer_id)
        if slot is None:
            return None
        status = self._status(slot)
        if status is TransferStatus.IN_PROGRESS and not is_alive(int(self._slots[slot, _S_WRITER])):
            self.finish(transfer_id, TransferStatus.FAILED, "the writer process died")
            status = self._status(slot)
        return status

    def error(self, transfer_id: str) -> str | None:
        slot = self._find(transfer_id)
        if slot is None:
            return None
        length = int(self._slots[slot, _S_ERR_LEN])
        if not length:
            return None
        at = HEADER_BYTES + slot * SLOT_BYTES + _ERR_AT
        return bytes(self._bytes[at : at + length]).decode(errors="replace")

    def bytes_received(self, transfer_id: str) -> int:
        slot = self._find(transfer_id)
        return 0 if slot is None else int(self._slots[slot, _S_BYTES])

    def wait(self, transfer_id: str, timeout: float | None) -> TransferStatus | None:
        """Polls (nothing runs on the receiver to wake it): 0.5 ms at first, up to 10 ms."""
        limit = None if timeout is None else time.monotonic() + timeout
        pause = 0.0005
        while True:
            status = self.status(transfer_id)
            if status is not None and status.is_terminal:
                return status
            if limit is not None and time.monotonic() >= limit:
                return status
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def finish(self, transfer_id: str, status: TransferStatus, error: str | None = None) -> None:
        assert status.is_terminal, status
        with self._table():
            slot = self._find(transfer_id)
            if slot is not None and not self._status(slot).is_terminal:
                self._end(slot, status, error)

    # Writer side.

    def begin(self, transfer_id: str) -> str | None:
        claim = self.claim(transfer_id)
        return claim if isinstance(claim, str) else None

    def claim(self, transfer_id: str) -> tuple[int, int] | str:
        """(slot, generation) for a new transfer, or why it is refused."""
        encoded = transfer_id.encode()
        if len(encoded) > MAX_ID_BYTES:
            return f"transfer id {transfer_id!r} is longer than {MAX_ID_BYTES} bytes"
        digest = _digest(transfer_id)
        with self._table():
            claim = self._claim_locked(transfer_id, digest)
            # Under the mutex too: a writer's copy threads share the index, and a prune beside
            # another thread's catch-up would lose entries (a forgotten id accepted again).
            self._tomb_index.prune()
        return claim

    def _claim_locked(self, transfer_id: str, digest: int) -> tuple[int, int] | str:
        """`claim`'s checks and the slot it takes, under the table mutex."""
        if self.is_closed:
            return "the peer closed"
        if self._tomb_index.contains(self._tombs, int(self._words[_H_NEXT_TOMB]), digest):
            return f"transfer {transfer_id!r} was already used and forgotten (use a fresh id)"
        known = self._find(transfer_id)
        if known is not None:
            if self._slots[known, _S_FENCED]:
                return f"transfer {transfer_id!r} was fenced by the receiver"
            return f"transfer id {transfer_id!r} was already used (retry with a fresh id)"
        slot = self._free_slot()
        if slot is None:
            return f"the receiver tracks {NUM_SLOTS} transfers already (none forgotten)"
        self._assign(slot, transfer_id, digest, TransferStatus.IN_PROGRESS, os.getpid())
        return slot, int(self._slots[slot, _S_GEN])

    def begin_copy(self, slot: int, generation: int, timeout: float) -> bool:
        """Enters a copy into the transfer's blocks (holding the slot mutex) if the transfer may
        still write; False: drop the bytes (fenced, ended, forgotten, or the lock timed out)."""
        if robust_mutex.lock(self._slot_mutex(slot), timeout) is Locked.TIMED_OUT:
            return False
        row = self._slots[slot]
        if (
            int(row[_S_GEN]) == generation
            and not row[_S_FENCED]
            and int(row[_S_STATE]) == _STATUSES.index(TransferStatus.IN_PROGRESS) + 1
        ):
            return True
        robust_mutex.unlock(self._slot_mutex(slot))
        return False

    def end_copy(self, slot: int, num_bytes: int) -> None:
        self._slots[slot, _S_BYTES] += np.uint64(num_bytes)
        robust_mutex.unlock(self._slot_mutex(slot))

    def finish_claim(
        self, slot: int, generation: int, status: TransferStatus, error: str | None = None
    ) -> TransferStatus | None:
        """Ends the writer's own transfer, if its slot still holds it, and returns the slot's
        status then, read under the same lock (None: forgotten since). A fence that won the race
        shows as CANCELLED; the decode may commit and forget the transfer right after, so the
        writer must not look it up again by id to learn whether it landed."""
        with self._table():
            if int(self._slots[slot, _S_GEN]) != generation:
                return None
            if not self._status(slot).is_terminal:
                self._end(slot, status, error)
            return self._status(slot)

    # Receiver side.

    def fence(self, transfer_id: str, timeout: float | None) -> bool:
        with self._table():
            slot = self._find(transfer_id)
            if slot is None:
                slot = self._free_slot()
                if slot is None:
                    return False  # full: retried by the caller, the writer is refused meanwhile
                self._assign(slot, transfer_id, _digest(transfer_id), TransferStatus.CANCELLED, 0)
                self._set_error(slot, "fenced by the receiver")
            self._slots[slot, _S_FENCED] = 1
            if not self._status(slot).is_terminal:
                self._end(slot, TransferStatus.CANCELLED, "fenced by the receiver")
        # No copy may be inside the blocks once we hold the slot mutex ourselves.
        if robust_mutex.lock(self._slot_mutex(slot), timeout) is Locked.TIMED_OUT:
            return False
        robust_mutex.unlock(self._slot_mutex(slot))
        return True

    def forget(self, transfer_id: str) -> bool:
        with self._table():
            slot = self._find(transfer_id)
            if slot is None:
                return True
            if not self._status(slot).is_terminal:
                return False
            if robust_mutex.lock(self._slot_mutex(slot), 0.0) is Locked.TIMED_OUT:
                return False  # a copy is inside: not quiet yet
            try:
                at = int(self._words[_H_NEXT_TOMB])
                self._tombs[at % MAX_TOMBSTONES] = self._slots[slot, _S_DIGEST]
                self._words[_H_NEXT_TOMB] = at + 1
                self._slots[slot, _S_GEN] += np.uint64(1)
                self._slots[slot, _S_STATE] = _FREE
                self._slots[slot, _S_DIGEST] = 0
            finally:
                robust_mutex.unlock(self._slot_mutex(slot))
            return True

    def close(self) -> None:
        """Refuses every new transfer and fails the running ones."""
        with self._table():
            self._words[_H_CLOSED] = 1
            running = np.flatnonzero(
                self._slots[:, _S_STATE] == _STATUSES.index(TransferStatus.IN_PROGRESS) + 1
            )
            for slot in running.tolist():
                self._end(int(slot), TransferStatus.FAILED, "the receiver closed")

    # Internals.

    def _slot_mutex(self, slot: int) -> int:
        return self._base + HEADER_BYTES + slot * SLOT_BYTES

    def _table(self) -> _TableLock:
        return _TableLock(self._base)

    def _find(self, transfer_id: str) -> int | None:
        digest = _digest(transfer_id)
        encoded = transfer_id.encode()
        for slot in np.flatnonzero(self._slots[:, _S_DIGEST] == digest).tolist():
            if int(self._slots[slot, _S_STATE]) == _FREE:
                continue
            at = HEADER_BYTES + slot * SLOT_BYTES + _ID_AT
            if bytes(self._bytes[at : at + int(self._slots[slot, _S_ID_LEN])]) == encoded:
                return int(slot)
        return None

    def _free_slot(self) -> int | None:
        """The lowest free slot (argmax stops at the first; flatnonzero listed them all)."""
        is_free = self._slots[:, _S_STATE] == _FREE
        slot = int(is_free.argmax())
        return slot if is_free[slot] else None

    def _status(self, slot: int) -> TransferStatus:
        return _STATUSES[int(self._slots[slot, _S_STATE]) - 1]

    def _assign(
        self, slot: int, transfer_id: str, digest: int, status: TransferStatus, writer: int
    ) -> None:
        """Fills a free slot (table mutex held); the state word is written last."""
        encoded = transfer_id.encode()
        at = HEADER_BYTES + slot * SLOT_BYTES + _ID_AT
        self._bytes[at : at + len(encoded)] = np.frombuffer(encoded, np.uint8)
        row = self._slots[slot]
        row[_S_ID_LEN] = len(encoded)
        row[_S_GEN] += np.uint64(1)
        row[_S_FENCED] = 0
        row[_S_BYTES] = 0
        row[_S_WRITER] = writer
        row[_S_ERR_LEN] = 0
        row[_S_DIGEST] = digest
        row[_S_STATE] = _STATUSES.index(status) + 1

    def _end(self, slot: int, status: TransferStatus, error: str | None) -> None:
        if error:
            self._set_error(slot, error)
        self._slots[slot, _S_STATE] = _STATUSES.index(status) + 1

    def _set_error(self, slot: int, error: str) -> None:
        encoded = error.encode()[:MAX_ERROR_BYTES]
        at = HEADER_BYTES + slot * SLOT_BYTES + _ERR_AT
        self._bytes[at : at + len(encoded)] = np.frombuffer(encoded, np.uint8)
        self._slots[slot, _S_ERR_LEN] = len(encoded)


class TombstoneIndex:
    """A writer's index of its peer's tombstone ring: each digest's newest forget, counting every
    forget since the table was made (forget k writes ring[k % size], then the count k + 1). A
    digest is in the ring exactly when its newest forget is among the last `size`, so `claim`
    reads only the entries forgotten since its last call instead of comparing all of them: 512
    KiB, which with the free-slot search's argmax took a claim from 137-174 to 99-112 us on the
    H200 host (2-core CPU host: 37 -> 24 us).

    Exact while the table mutex is held, as `forget` writes both the entry and the count under
    it. At most `max_catch_up` entries are read per claim (4,096: ~1 ms under the peer's mutex;
    all 65,536 at once took 17 ms), and until the index has caught up (a writer new to a
    receiver that forgot many) the claim compares the whole ring as before. (A receiver killed
    between its two writes leaves an entry the count does not cover, which only a compare
    sees; that table's transfers fail anyway, the peer being dead.)"""

    def __init__(self, size: int, max_catch_up: int = 4096) -> None:
        self.size = size
        self.max_catch_up = max_catch_up
        # digest → its newest forget seen (those past the ring's last `size` are pruned)
        self._newest: dict[int, int] = {}
        self._num_seen = 0

    def contains(self, tombs: np.ndarray, num_forgotten: int, digest: int) -> bool:
        """Whether `digest` is in the ring `tombs` (uint64 [size]) after `num_forgotten`
        forgets; the table mutex is held."""
        assert len(tombs) == self.size and num_forgotten >= self._num_seen, num_forgotten
        # Entries older than the ring's last `size` are gone from it: never read.
        first = max(self._num_seen, num_forgotten - self.size)
        end = min(num_forgotten, first + self.max_catch_up)
        if first < end:
            digests = tombs[np.arange(first, end) % self.size].tolist()
            self._newest.update(zip(digests, range(first, end), strict=True))
        self._num_seen = end
        if end < num_forgotten:  # still behind
            return bool((tombs == digest).any())
        newest = self._newest.get(digest)
        return newest is not None and newest >= num_forgotten - self.size

    def prune(self) -> None:
        """Drops digests that left the ring, once there are twice as many as it holds."""
        if len(self._newest) > 2 * self.size:
            oldest = self._num_seen - self.size
            self._newest = {d: k for d, k in self._newest.items() if k >= oldest}


class _TableLock:
    """The table mutex as a context manager. It guards only short bookkeeping, so it waits
    without a timeout; a holder that died hands it over (its half-done update is harmless:
    a slot's state word is always written last)."""

    def __init__(self, base: int) -> None:
        self._base = base

    def __enter__(self) -> None:
        robust_mutex.lock(self._base, None)

    def __exit__(self, *exc: object) -> None:
        robust_mutex.unlock(self._base)
