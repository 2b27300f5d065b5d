"""The KV cache dtype, chosen on its own: validation, the ``auto`` rule, the runner's caches and
block size, the torch attention over a cache narrower than the query, a tiny model end to end,
and two engines whose KV dtypes differ refusing each other's pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.config import EngineConfig
from services.engine.dtype_choice import choose_kv_cache_dtype
from services.engine.kv_layout import layer_copies
from services.models.attention import (
    AttentionMetadata,
    PaddedPrefill,
    PrefillSpan,
    TorchPagedAttention,
)


def test_a_bad_kv_cache_dtype_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .* got 'int8'"):
        EngineConfig(model_dir=tmp_path, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype float16 is supported on GPU only"):
        EngineConfig(model_dir=tmp_path, kv_cache_dtype="float16")
    # The Triton kernels read the cache in the compute dtype: a mix is refused up front.
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 differs from dtype float32"):
        EngineConfig(model_dir=tmp_path, dtype="float32", kv_cache_dtype="bfloat16", device="cuda")
    with pytest.raises(ValueError, match="kv_cache_dtype float32 differs from dtype bfloat16"):
        EngineConfig(
            model_dir=tmp_path,
            dtype="bfloat16",
            kv_cache_dtype="float32",
            attention_backend="triton",
        )
    assert EngineConfig(model_dir=tmp_path).kv_cache_dtype == "auto"
    assert EngineConfig(model_dir=tmp_path, device="cuda", kv_cache_dtype="bfloat16")
    # fp8 E5M2 is a CPU cache: refused for CUDA and the Triton kernels whatever the dtype.
    assert EngineConfig(model_dir=tmp_path, kv_cache_dtype="fp8_e5m2")
    for where in ({"device": "cuda"}, {"attention_backend": "triton"}):
        for dtype in ("auto", "bfloat16"):
            with pytest.raises(ValueError, match="fp8_e5m2 is supported on CPU only"):
                EngineConfig(model_dir=tmp_path, dtype=dtype, kv_cache_dtype="fp8_e5m2", **where)
    # vLLM's "fp8" is E4M3 on a GPU: not silently taken for E5M2.
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*fp8_e5m2.* got 'fp8'"):
        EngineConfig(model_dir=tmp_path, kv_cache_dtype="fp8")


def test_auto_is_bfloat16_on_cpu_and_the_compute_dtype_with_triton() -> None:
    for compute in ("float32", "bfloat16"):
        choice = choose_kv_cache_dtype("auto", compute, "cpu")
        assert (choice.dtype, choice.reason) == ("bfloat16", "cpu default")
        assert choose_kv_cache_dtype("auto", compute, "cpu", "native").dtype == "bfloat16"
        triton = choose_kv_cache_dtype("auto", compute, "cpu", "triton")
        assert (triton.dtype, triton.reason) == (compute, "compute dtype")
        assert choose_kv_cache_dtype("auto", compute, "cuda:0").dtype == compute
    assert choose_kv_cache_dtype("auto", "float16", "cuda").dtype == "float16"
    explicit = choose_kv_cache_dtype("float32", "float32", "cpu")
    assert (explicit.dtype, explicit.reason) == ("float32", "explicit")
    assert choose_kv_cache_dtype("float32", "bfloat16", "cpu").dtype == "float32"
    # dtype auto on CUDA resolves to bfloat16 at start-up: only then can this be checked.
    with pytest.raises(ValueError, match="kv_cache_dtype float32 differs from the compute dtype"):
        choose_kv_cache_dtype("float32", "bfloat16", "cuda")
    with pytest.raises(ValueError, match="kv_cache_dtype float16 is supported on GPU only"):
        choose_kv_cache_dtype("float16", "float32", "cpu")
    for compute in ("float32", "bfloat16"):
        fp8 = choose_kv_cache_dtype("fp8_e5m2", compute, "cpu", "native")
        assert (fp8.dtype, fp8.reason) == ("fp8_e5m2", "explicit")
        with pytest.raises(ValueError, match="fp8_e5m2 is supported on CPU only"):
            choose_kv_cache_dtype("fp8_e5m2", compute, "cuda")
    with pytest.raises(ValueError, match="fp8_e5m2 is supported on CPU only"):
        choose_kv_cache_dtype("fp8_e5m2", "float32", "cpu", "triton")
    with pytest.raises(ValueError, match="must be auto, .* or fp8_e5m2, got 'fp8_e4m3'"):
        choose_kv_cache_dtype("fp8_e4m3", "float32", "cpu")


def test_the_runner_allocates_and_sizes_blocks_in_the_kv_dtype(tiny_llama_dir: Path) -> None:
    def engine(kv_cache_dtype: str):
        return LLM(
            tiny_llama_dir,
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            attention_backend="torch",
            max_model_len=64,
            kv_cache_memory=1 << 20,
        ).engine

    narrow, wide, fp8 = engine("auto"), engine("float32"), engine("fp8_e5m2")
    assert narrow.runner.dtype == torch.float32  # compute stays fp32
    assert narrow.kv_dtype_choice.dtype == "bfloat16" and narrow.kv_layout.dtype == "bfloat16"
    assert all(cache.dtype == torch.bfloat16 for cache in narrow.kv_caches)
    assert all(cache.dtype == torch.float32 for cache in wide.kv_caches)
    assert narrow.runner.block_bytes * 2 == wide.runner.block_bytes
    assert narrow.kv_layout.block_bytes * 2 == wide.kv_layout.block_bytes
    # The same memory holds twice the blocks, and the layout describes the tensors' bytes.
    assert narrow.kv_layout.num_blocks == 2 * wide.kv_layout.num_blocks
    assert narrow.kv_caches[0].nbytes == narrow.kv_layout.layer_bytes
    # fp8 E5M2: a byte an element, twice bf16's blocks in the same memory.
    assert all(cache.dtype == torch.float8_e5m2 for cache in fp8.kv_caches)
    assert fp8.kv_layout.dtype == "fp8_e5m2" and fp8.runner.dtype == torch.float32
    assert fp8.runner.block_bytes * 2 == narrow.runner.block_bytes
    assert fp8.kv_layout.num_blocks == 2 * narrow.kv_layout.num_blocks
    assert fp8.kv_caches[0].nbytes == fp8.kv_layout.layer_bytes


# ---- the torch path over a bf16 cache under an fp32 query ----

BLOCK, KV_HEADS, GROUP, DIM, NUM_BLOCKS = 4, 2, 2, 8, 40


def _slots(blocks: list[int], positions: range) -> list[int]:
    return [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


def _metadata(
    decodes: list[tuple[list[int], int]], prefills: list[tuple[list[int], int, int]]
) -> AttentionMetadata:
    """decodes: (blocks, context length incl. the new token); prefills: (blocks, start, n)."""
    slots: list[int] = []
    for blocks, length in decodes:
        slots += _slots(blocks, range(length - 1, length))
    spans, token = [], len(decodes)
    for blocks, start, n in prefills:
        spans.append(PrefillSpan(token, n, start, torch.tensor(blocks)))
        slots += _slots(blocks, range(start, start + n))
        token += n
    width = max((len(b) for b, _ in decodes), default=1)
    tables = [b + [0] * (width - len(b)) for b, _ in decodes]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=len(decodes),
        decode_block_tables=torch.tensor(tables, dtype=torch.int64).view(len(decodes), width),
        decode_seq_lens=torch.tensor([n for _, n in decodes], dtype=torch.int64),
        prefills=spans,
    )


STEPS = {
    # Two decodes and a chunk with nothing cached before it (attends to the fresh K/V).
    "decodes and a fresh chunk": _metadata([([1, 2], 5), ([3, 4, 5], 9)], [([6, 7], 0, 7)]),
    # A chunk continuing a prompt: it reads the cache, its own new tokens included.
    "a continued chunk": _metadata([([1, 2], 6)], [([8, 9, 10], 6, 5)]),
    # Two chunks of similar size: one padded, masked call.
    "padded chunks": _metadata([], [([11, 12], 3, 4), ([13, 14], 0, 6)]),
}


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("step", list(STEPS))
def test_torch_path_with_a_narrow_cache_differs_only_by_the_cache_rounding(
    step: str, cache_dtype: torch.dtype
) -> None:
    metadata = STEPS[step]
    padded = PaddedPrefill.build(metadata.prefills, BLOCK) is not None
    assert padded == (step == "padded chunks")  # each of the three prefill paths is covered
    num_tokens = metadata.slot_mapping.numel()
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(num_tokens, KV_HEADS * GROUP, DIM, generator=gen)
    key = torch.randn(num_tokens, KV_HEADS, DIM, generator=gen)
    value = torch.randn(num_tokens, KV_HEADS, DIM, generator=gen)
    # Earlier tokens' K/V already in the cache.
    history = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen)

    def run(query, key, value, cache) -> torch.Tensor:
        backend = TorchPagedAttention(BLOCK, DIM**-0.5)
        backend.prepare(metadata)
        return backend.forward(query, key, value, cache, metadata)

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(cache_dtype).float()

    narrow_cache = history.to(cache_dtype)
    out = run(query, key, value, narrow_cache)
    # The reference: an fp32 cache and fp32 K/V holding exactly the rounded values.
    expected = run(query, rounded(key), rounded(value), rounded(history))

    assert out.dtype == torch.float32 and narrow_cache.dtype == cache_dtype
    assert torch.equal(out, expected)
    # New K/V written, rounded once; the slots no step wrote keep the history.
    written = rounded(history)
    for cache, rows in ((written[0], key), (written[1], value)):
        cache.view(-1, KV_HEADS, DIM)[metadata.slot_mapping] = rounded(rows)
    assert torch.equal(narrow_cache.float(), written)
    # And the rounding mattered: unrounded K/V give another result.
    assert not torch.equal(out, run(query, key, value, history.clone()))


# ---- end to end on the tiny model ----

PROMPTS = [[5, 17, 300, 41], list(range(20, 70)), [7] * 33]


def _skip_without_native_kernels() -> None:
    from services.models.native_build import native_kernel_error

    if (error := native_kernel_error()) is not None:
        pytest.skip(f"native attention kernel unavailable: {error}")


def _greedy(model_dir: Path, backend: str, kv_cache_dtype: str) -> list[list[int]]:
    """16 greedy tokens for each of ``PROMPTS`` in fp32 compute over a cache of
    ``kv_cache_dtype``; the 50-token prompt is chunked, so its second chunk reads the cache."""
    llm = LLM(
        model_dir,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        block_size=16,
        max_num_batched_tokens=32,
        kv_cache_memory=4 << 20,
        attention_backend=backend,
    )
    # The layout peers copy pages by describes the tensors' bytes, whatever the dtype.
    assert all(cache.nbytes == llm.engine.kv_layout.layer_bytes for cache in llm.engine.kv_caches)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert [len(ids) for ids in tokens] == [16] * len(PROMPTS)
    return tokens


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_fp32_compute_over_a_bf16_cache_keeps_the_fp32_greedy_tokens(
    tiny_llama_dir: Path, backend: str
) -> None:
    if backend == "native":
        _skip_without_native_kernels()
    assert _greedy(tiny_llama_dir, backend, "auto") == _greedy(tiny_llama_dir, backend, "float32")


def test_an_fp8_cache_gives_the_same_greedy_tokens_on_the_native_and_torch_paths(
    tiny_llama_dir: Path,
) -> None:
    """Both paths round K/V to E5M2 once and widen them exactly; in fp32 compute the native
    kernels' other summation order must not change a greedy token. And the rounding is real:
    a float32 cache's tokens differ somewhere."""
    _skip_without_native_kernels()
    native = _greedy(tiny_llama_dir, "native", "fp8_e5m2")
    assert native == _greedy(tiny_llama_dir, "torch", "fp8_e5m2")
    assert native != _greedy(tiny_llama_dir, "native", "float32")


def test_engines_with_different_kv_dtypes_refuse_each_others_pages(tiny_llama_dir: Path) -> None:
    def layout(dtype: str, kv_cache_dtype: str):
        return LLM(
            tiny_llama_dir,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend="torch",
            max_model_len=64,
            kv_cache_memory=1 << 20,
        ).engine.kv_layout

    fp32_kv = layout("float32", "float32")
    bf16_kv = layout("float32", "auto")
    with pytest.raises(ValueError, match="KV layouts differ: .*dtype float32 vs bfloat16"):
        layer_copies(fp32_kv, [0], bf16_kv, [0])
    # The compute dtype is not part of the layout: a bf16-compute node and an fp32-compute node
    # with the default (bf16) KV cache exchange pages.
    assert layout("bfloat16", "auto").fingerprint == bf16_kv.fingerprint
