"""KV cache sizing on a GPU: what a profiling step leaves of gpu_memory_utilization x total.
The arithmetic runs on fake memory readings; the profiling step itself runs on CPU too."""

from __future__ import annotations

import pytest
import torch

from services.engine import CacheConfig, EngineConfig, SchedulerConfig
from services.engine.gpu_memory import MemorySnapshot, kv_cache_budget
from services.engine.model_runner import ModelRunner
from services.models.config import ModelConfig

GiB = 1 << 30


def snapshot(**overrides: int) -> MemorySnapshot:
    values = dict(
        total_bytes=80 * GiB,
        free_bytes=60 * GiB,
        torch_peak_bytes=17 * GiB,  # weights 16 GiB + 1 GiB of activations at the peak
        torch_reserved_bytes=18 * GiB,
    )
    values.update(overrides)
    return MemorySnapshot(**values)


def test_budget_is_utilization_minus_peak_and_non_torch_memory() -> None:
    snap = snapshot()
    # 80 - 60 - 18 = 2 GiB in use outside torch (context, workspaces, other processes).
    assert snap.non_torch_bytes == 2 * GiB
    assert kv_cache_budget(snap, 0.9) == int(80 * GiB * 0.9) - 17 * GiB - 2 * GiB
    assert kv_cache_budget(snap, 0.5) == 40 * GiB - 19 * GiB
    # Another process holding 10 GiB shrinks the budget by as much.
    other = snapshot(free_bytes=50 * GiB)
    assert kv_cache_budget(snap, 0.9) - kv_cache_budget(other, 0.9) == 10 * GiB


def test_no_room_names_the_flag() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2.*max_num_batched_tokens"):
        kv_cache_budget(snapshot(), 0.2)


class FakeReader:
    """Reports a device of ``total`` bytes on which the profiling step peaked at ``peak``."""

    def __init__(self, total: int, peak: int) -> None:
        self.total, self.peak = total, peak
        self.resets = 0

    def reset_peak(self) -> None:
        self.resets += 1

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(
            total_bytes=self.total,
            free_bytes=self.total - self.peak,
            torch_peak_bytes=self.peak,
            torch_reserved_bytes=self.peak,
        )


def test_runner_sizes_the_cache_after_a_profiling_step(tiny_llama_dir) -> None:
    # max_num_batched_tokens above max_model_len: the profile splits it into chunks.
    config = EngineConfig(
        model_dir=tiny_llama_dir,
        dtype="float32",
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=300),
    )
    runner = ModelRunner(ModelConfig.from_model_dir(tiny_llama_dir), config, max_model_len=128)
    calls = []
    original = runner.model.forward
    runner.model.forward = lambda ids, *a: calls.append(ids.shape[0]) or original(ids, *a)
    reader = FakeReader(total=64 << 20, peak=16 << 20)
    cache = CacheConfig(gpu_memory_utilization=0.5)
    num_blocks = runner.num_blocks_for(cache, reader)
    assert reader.resets == 1
    assert calls == [300]  # one forward of max_num_batched_tokens tokens
    assert num_blocks == ((32 << 20) - (16 << 20)) // runner.block_bytes


def test_an_explicit_cache_larger_than_the_free_memory_names_the_flag(tiny_llama_dir) -> None:
    config = EngineConfig(model_dir=tiny_llama_dir, dtype="float32")
    runner = ModelRunner(ModelConfig.from_model_dir(tiny_llama_dir), config, max_model_len=128)
    reader = FakeReader(total=64 << 20, peak=48 << 20)  # 16 MiB free
    fits = runner.num_blocks_for(CacheConfig(kv_cache_memory=8 << 20), reader)
    assert fits == (8 << 20) // runner.block_bytes
    with pytest.raises(ValueError, match=r"kv_cache_memory=0.02 GiB does not fit.*0.02 GiB free"):
        runner.num_blocks_for(CacheConfig(kv_cache_memory=24 << 20), reader)
    assert reader.resets == 0  # no profiling step when the size is given


@pytest.mark.gpu
def test_cuda_cache_respects_utilization(tiny_llama_dir) -> None:
    from services.engine import LLM

    llm = LLM(tiny_llama_dir, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3)
    runner = llm.engine.runner
    cache_bytes = sum(c.nbytes for c in runner.kv_caches)
    _, total = torch.cuda.mem_get_info()
    assert 0 < cache_bytes <= 0.3 * total
    assert torch.cuda.memory_allocated() <= 0.3 * total
