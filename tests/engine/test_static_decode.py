"""The static decode path (CUDA-graph-ready buffers, batch buckets, a dummy block for padding
rows) yields the dynamic path's tokens exactly. On CPU it runs eagerly on the same buffers; the
``gpu`` test checks graph replay against eager on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.model_runner import use_device
from services.engine.static_decode import batch_buckets

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4096) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def make_llm(
    model_dir, cuda_graphs: bool | None, backend: str = "torch", device: str = "cpu"
) -> LLM:
    return LLM(
        model_dir,
        dtype="float32",
        device=device,
        block_size=8,
        max_model_len=64,
        max_num_seqs=6,
        kv_cache_memory=1 << 22,
        attention_backend=backend,
        cuda_graphs=cuda_graphs,
    )


def test_off_by_default_on_cpu(tiny_llama_dir) -> None:
    llm = make_llm(tiny_llama_dir, cuda_graphs=None)
    assert llm.engine.runner.static_decode is None
    assert llm.engine.kv_cache.num_blocks == llm.engine.runner.kv_caches[0].shape[1]


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(70) == [1, 2, 4, 8, 16, 32, 48, 64, 70]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_decode_matches_dynamic(tiny_llama_dir, backend: str) -> None:
    # 9 prompts, at most 6 running: batches of 6, 5, 3... fill buckets 6 and 4 with padding rows.
    batch = prompts(9 if backend == "torch" else 3)
    params = [
        SamplingParams(max_tokens=4 + 3 * (i % 3), temperature=0.0, ignore_eos=True)
        for i in range(len(batch))
    ]
    dynamic = make_llm(tiny_llama_dir, cuda_graphs=False, backend=backend)
    static = make_llm(tiny_llama_dir, cuda_graphs=True, backend=backend)
    assert dynamic.engine.runner.static_decode is None
    runner = static.engine.runner
    assert runner.static_decode is not None
    # The dummy block is the cache's last block, outside the pool.
    num_physical = runner.kv_caches[0].shape[1]
    assert static.engine.kv_cache.num_blocks == num_physical - 1
    assert runner.static_decode.dummy_block == num_physical - 1

    calls = []
    original = runner.static_decode.run
    runner.static_decode.run = lambda *a, **k: (
        calls.append(len(k["token_ids"])) or original(*a, **k)
    )
    expected = [o.token_ids for o in dynamic.generate(batch, params)]
    assert [o.token_ids for o in static.generate(batch, params)] == expected
    assert calls, "no step took the static path"
    assert static.engine.stats().num_blocks_used == 0


def test_static_decode_runs_speculative_rows_as_the_dynamic_path(tiny_llama_dir) -> None:
    """With speculation, a decode step has a row per request and proposal: the static buffers
    take up to max_num_seqs x (1 + num_speculative_tokens) rows."""
    batch = [[3, 4] * 10, [9, 10, 11] * 6, *prompts(4)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    spec = {"num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    dynamic = LLM(tiny_llama_dir, dtype="float32", block_size=8, max_model_len=64,
                  max_num_seqs=6, kv_cache_memory=1 << 22, attention_backend="torch")  # fmt: skip
    static = LLM(tiny_llama_dir, dtype="float32", block_size=8, max_model_len=64, max_num_seqs=6,
                 kv_cache_memory=1 << 22, attention_backend="torch", cuda_graphs=True,
                 speculative_config=spec)  # fmt: skip
    runner = static.engine.runner
    assert runner.static_decode is not None and runner.static_decode.max_batch == 24
    rows = []
    original = runner.static_decode.run
    runner.static_decode.run = lambda *a, **k: rows.append(len(k["token_ids"])) or original(*a, **k)
    expected = [o.token_ids for o in dynamic.generate(batch, params)]
    assert [o.token_ids for o in static.generate(batch, params)] == expected
    assert max(rows) > 6, "no step ran more rows than requests on the static path"
    assert static.engine.stats().num_accepted_tokens_total > 0


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager(tiny_llama_dir) -> None:
    batch = prompts(5)
    eager = make_llm(tiny_llama_dir, cuda_graphs=False, backend="auto", device="cuda")
    graphs = make_llm(tiny_llama_dir, cuda_graphs=True, backend="auto", device="cuda")
    assert graphs.engine.runner.static_decode._graphs, "no graph was captured"
    expected = [o.token_ids for o in eager.generate(batch, GREEDY)]
    assert [o.token_ids for o in graphs.generate(batch, GREEDY)] == expected
    torch.cuda.synchronize()


def test_a_runner_on_cuda_n_makes_it_the_current_device(monkeypatch) -> None:
    """Graphs, streams, events and Triton launches follow the current device, not the tensors':
    a runner on ``cuda:1`` must make it current (a plain ``cuda`` is the current one already)."""
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for name in ("cuda:1", "cuda", "cpu"):
        use_device(torch.device(name))
    assert calls == [torch.device("cuda:1")]


@pytest.mark.gpu
def test_graphs_on_a_second_gpu_give_the_first_gpus_tokens(tiny_llama_dir) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    batch = prompts(4)
    first = make_llm(tiny_llama_dir, cuda_graphs=True, backend="auto", device="cuda:0")
    expected = [o.token_ids for o in first.generate(batch, GREEDY)]
    second = make_llm(tiny_llama_dir, cuda_graphs=True, backend="auto", device="cuda:1")
    assert second.engine.runner.static_decode._graphs, "no graph was captured"
    assert [o.token_ids for o in second.generate(batch, GREEDY)] == expected
