"""A prefill engine pushing KV pages into a decode node's TransferManager, in one process.

The prefill side is an ``EngineCore`` with a loopback writer; the decode side an ``AsyncEngine``
with a loopback receiver and the ``TransferManager`` under test. Both transports and the manager
read one clock: a test that passes a ``FakeClock`` moves leases and deadlines on by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from decode_node.transfers import Transfer, TransferManager
from kv_transfer import (
    KvTransport,
    LoopbackFaults,
    LoopbackTransport,
    PageCopy,
    TransferHandle,
    make_transport,
)
from services.async_engine import AsyncEngine
from services.engine import LLM, EngineCore, SamplingParams
from services.engine.kv_layout import layer_copies

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def make_engine(model_dir: Path, kv_bytes: int) -> EngineCore:
    return LLM(model_dir, dtype="float32", max_model_len=256, kv_cache_memory=kv_bytes).engine


def register_kv(transport: KvTransport, engine: EngineCore) -> None:
    for layer, cache in enumerate(engine.kv_caches):
        transport.register(f"kv.layer{layer}", cache.view(-1).view(torch.uint8).numpy())


class Pair:
    """A prefill engine + writer transport and a decode AsyncEngine + TransferManager."""

    def __init__(
        self,
        model_dir: Path,
        faults: LoopbackFaults | None = None,
        clock: Callable[[], float] = time.monotonic,
        **manager_kw: Any,
    ) -> None:
        self.clock = clock
        self.prefill = make_engine(model_dir, 3 << 20)
        self.writer = LoopbackTransport(faults, clock=clock)
        register_kv(self.writer, self.prefill)
        decode_engine = make_engine(model_dir, 5 << 20)
        self.receiver = make_transport("loopback", clock=clock)
        register_kv(self.receiver, decode_engine)
        self.decode = AsyncEngine(decode_engine)
        self.decode.start()
        self.manager = TransferManager(self.decode, self.receiver, clock=clock, **manager_kw)

    def first_token(self, request_id: str, prompt: list[int]) -> int:
        self.prefill.add_request(request_id, prompt, FIRST, hold_kv=True)
        while self.prefill.has_unfinished_requests:
            for out in self.prefill.step():
                token = out.new_token_ids[0]
        return token

    def push(self, request_id: str, transfer: Transfer, timeout: float = 5.0) -> TransferHandle:
        copies = layer_copies(
            self.prefill.kv_layout,
            self.prefill.kv_block_ids(request_id),
            self.decode.engine.kv_layout,
            transfer.block_ids,
        )
        pages = [
            PageCopy(
                f"kv.layer{c.layer}", c.src_offset, f"kv.layer{c.layer}", c.dst_offset, c.length
            )
            for c in copies
        ]
        peer = self.receiver.address()
        self.writer.connect(peer)
        return self.writer.write(
            peer, pages, transfer_id=transfer.transfer_id, deadline=self.clock() + timeout
        )

    async def decode_blocks_used(self) -> int:
        return await self.decode.call(lambda e: e.stats().num_blocks_used)

    def close(self) -> None:
        self.decode.shutdown()
        self.writer.close()
        self.receiver.close()
