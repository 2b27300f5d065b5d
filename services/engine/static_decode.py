"""Decode-only steps on static buffers, replayed as CUDA graphs on a GPU.

Why: a decode step of a small model on a GPU is mostly kernel-launch overhead (hundreds of small
kernels per step); a CUDA graph replays them in one launch. A graph records device addresses
and shapes, so everything a step reads must live in tensors allocated once:

- with LoRA on, each row's adapter slot (``LoraState``) is a static input too: the graph
  computes the adapters' mask from it and reads their stacked weights, which loading an adapter
  rewrites in place, so graphs captured before any adapter was loaded serve them all. Each
  bucket gets a second graph without the deltas, replayed when no row has an adapter (on an
  H200, graphs that always ran them took the 1B model's offline run of base-model requests to
  0.74x the tok/s of the same run without LoRA);
- batch-size buckets (1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``): a step of ``n``
  decodes runs the smallest bucket >= n, its padding rows doing harmless work;
- static buffers of the largest bucket: token ids, positions, slot mapping, sequence lengths
  (all on the device), and block tables of a fixed width (``max_model_len`` / ``block_size``),
  so the attention kernels' grid and split count depend on the bucket alone;
- padding rows (and table columns past a context) point at a reserved dummy block that the
  block pool never hands out: a padding row writes its K/V there and attends over one token;
- each step fills them from pinned host twins with two asynchronous copies (``_stage``), so
  the host never waits for the GPU before the replay.

Life cycle: built by the model runner after the KV cache is allocated (the dummy block is the
cache's last block); ``capture`` once (CUDA only: warm-up, then one graph per bucket, largest
first, sharing one memory pool); then ``run`` for every decode-only step with at most
``max_batch`` requests. On CPU nothing is captured and ``run`` calls the model eagerly on the
same buffers, which is how the CPU suite checks the static path against the dynamic one.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from services.models.attention import AttentionBackend, AttentionMetadata
from services.models.lora import LoraState

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to and including ``max_num_seqs``."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


class StaticDecode:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        dummy_block: int,
        use_graphs: bool,
        lora: LoraState | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.dummy_block = dummy_block
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        device = kv_caches[0].device
        size = self.max_batch
        # Static inputs, on the device: rows [5, max_batch] int64 (token ids, positions, slot
        # mapping, sequence lengths, LoRA adapter slots), block_tables [max_batch, max_blocks]
        # int64.
        self._rows = torch.zeros((5, size), dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.adapter_slots = (
            self._rows
        )
        self.block_tables = torch.full(
            (size, self.max_blocks), dummy_block, dtype=torch.int64, device=device
        )
        # Their host staging twins, pinned on CUDA so that a step's two copies are queued
        # behind the previous step's work instead of waiting for it. ``_staged`` marks when the
        # copies have read them, before the next step writes them again.
        pinned = device.type == "cuda"
        self._host_rows = torch.zeros((5, size), dtype=torch.int64, pin_memory=pinned)
        self._host_tables = torch.full(
            (size, self.max_blocks), dummy_block, dtype=torch.int64, pin_memory=pinned
        )
        self._staged = torch.cuda.Event() if pinned else None  # type: ignore[no-untyped-call]
        self._columns = np.arange(self.max_blocks)  # [max_blocks]: a table's column indices
        self._stage([], [], [], [], [], size)
        self._metadata = {b: self._bucket_metadata(b) for b in self.buckets}
        self.use_graphs = use_graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        """Per (bucket, with the adapters' deltas): its graph."""
        self._outputs: dict[tuple[int, bool], torch.Tensor] = {}
        """The hidden states [bucket, hidden_size] each graph writes."""
        self._variants = (True, False) if lora is not None else (False,)
        """With the adapters' deltas, without: the graphs captured per bucket."""

    def bucket_for(self, num_decodes: int) -> int | None:
        """The smallest bucket that holds ``num_decodes``, or None (run the dynamic path)."""
        return next((b for b in self.buckets if b >= num_decodes), None)

    def _bucket_metadata(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decodes=bucket,
            decode_block_tables=self.block_tables[:bucket],
            decode_seq_lens=self.seq_lens[:bucket],
            prefills=[],
        )

    def _stage(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        adapter_slots: Sequence[int],
        bucket: int,
    ) -> None:
        """Write rows [0:bucket) of the static inputs: the decodes, then padding rows (token 0
        at position 0, written to the dummy block's first slot, without an adapter), through
        the host staging buffers and one copy per buffer."""
        if self._staged is not None:
            self._staged.synchronize()  # the last step's copies have read the staging buffers
        num = len(token_ids)
        rows = self._host_rows.numpy()
        rows[0, :num] = token_ids
        rows[1, :num] = positions
        rows[2, :num] = slots
        rows[3, :num] = rows[1, :num] + 1
        rows[4, :num] = adapter_slots if adapter_slots else -1
        rows[:, num:bucket] = [[0], [0], [self.dummy_block * self.block_size], [1], [-1]]
        # Block tables: each row's ids, then the dummy block; a few whole-array operations for
        # the batch instead of two per row (64 rows: ~0.1 ms of a GPU step's host time).
        tables = self._host_tables.numpy()
        lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=num)
        ids = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(lengths.sum())
        )
        tables[:bucket] = self.dummy_block
        tables[:num][self._columns < lengths[:, None]] = ids  # row-major: each row's ids in order
        self._rows.copy_(self._host_rows, non_blocking=True)
        self.block_tables[:bucket].copy_(self._host_tables[:bucket], non_blocking=True)
        if self._staged is not None:
            self._staged.record()

    def _forward(self, bucket: int, adapters: bool) -> torch.Tensor:
        """The model over rows [0:bucket); ``adapters``: with the LoRA deltas of each row's
        slot (False: none, as if every row ran the base model)."""
        metadata = self._metadata[bucket]
        self.backend.prepare(metadata)
        if self.lora is None:
            return self._model(bucket, metadata)
        with self.lora.step(self.adapter_slots[:bucket] if adapters else None):
            return self._model(bucket, metadata)

    def _model(self, bucket: int, metadata: AttentionMetadata) -> torch.Tensor:
        hidden: torch.Tensor = self.model(
            self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, metadata
        )
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """One CUDA graph per bucket (CUDA only), largest first so smaller ones reuse its pool."""
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                for adapters in self._variants:
                    # warm-up: autotuning, lazy init, kernel compiles
                    self._forward(bucket, adapters)
        torch.cuda.current_stream().wait_stream(stream)
        for bucket in reversed(self.buckets):
            for adapters in self._variants:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[bucket, adapters] = self._forward(bucket, adapters)
                self._graphs[bucket, adapters] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %s)", len(self._graphs), self.buckets)

    @torch.inference_mode()
    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        adapter_slots: Sequence[int] = (),
    ) -> torch.Tensor:
        """Hidden states [num_decodes, hidden_size] of one decode-only step; decode i is token
        ``token_ids[i]`` at ``positions[i]``, written to ``slots[i]``, over ``block_tables[i]``,
        with LoRA adapter slot ``adapter_slots[i]`` (-1: none; empty: none for every row)."""
        num = len(token_ids)
        bucket = self.bucket_for(num)
        assert bucket is not None, f"{num} decodes exceed the largest bucket {self.max_batch}"
        self._stage(token_ids, positions, slots, block_tables, adapter_slots, bucket)
        key = (bucket, any(slot >= 0 for slot in adapter_slots))
        graph = self._graphs.get(key)
        if graph is None:
            return self._forward(*key)[:num]
        graph.replay()
        return self._outputs[key][:num]
