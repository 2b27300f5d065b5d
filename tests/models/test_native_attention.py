"""The native decode kernel against ``TorchPagedAttention._decode`` on random paged caches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.models.attention import AttentionMetadata, TorchPagedAttention
from services.models.native_attention import NativePagedAttention
from services.models.native_build import native_kernel_error, supported_isas
from support.decode_batch import SEQ_LENS, decode, make_decode_batch
from support.torch_threads import torch_threads


@pytest.fixture(scope="module")
def kernel() -> None:
    error = native_kernel_error()
    if error is not None:
        pytest.skip(f"native attention kernel unavailable: {error}")


@pytest.mark.skipif(not os.environ.get("CI"), reason="a compiler is only required on CI")
def test_kernel_builds_on_ci() -> None:
    assert native_kernel_error() is None


def backends(head_dim: int, block_size: int) -> tuple[TorchPagedAttention, NativePagedAttention]:
    scale = head_dim**-0.5
    return TorchPagedAttention(block_size, scale), NativePagedAttention(block_size, scale)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 40, 80])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
def test_float32_matches_torch(group: int, head_dim: int, block_size: int) -> None:
    # head_dim 40 and 80 take the generic path (80 without, 40 with a partial vector).
    query, kv_cache, metadata = make_decode_batch(
        SEQ_LENS, group=group, head_dim=head_dim, block_size=block_size
    )
    reference, native = backends(head_dim, block_size)

    out = decode(native, query, kv_cache, metadata)

    assert out.shape == query.shape and out.dtype == torch.float32
    torch.testing.assert_close(
        out, decode(reference, query, kv_cache, metadata), atol=1e-5, rtol=1e-5
    )


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 40])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
def test_bfloat16_matches_torch(group: int, head_dim: int, block_size: int) -> None:
    query, kv_cache, metadata = make_decode_batch(
        SEQ_LENS, group=group, head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16
    )
    reference, native = backends(head_dim, block_size)

    out = decode(native, query, kv_cache, metadata)

    # The exact answer for these bf16 inputs, computed in fp32: the kernel accumulates in fp32,
    # so it is off only by rounding its output to bf16 (plus summation order).
    expected = decode(reference, query.float(), kv_cache.float(), metadata)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1.6e-2)
    # And as close to the torch path in bf16 as that is to the exact answer.
    torch_bf16 = decode(reference, query, kv_cache, metadata).float()
    assert (out.float() - expected).abs().max() <= (torch_bf16 - expected).abs().max() + 4e-3


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_never_reads_past_the_context(dtype: torch.dtype) -> None:
    # NaN in every slot no sequence owns: the rest of each last block, every other block.
    seq_lens = [1, 15, 16, 17, 40]
    query, kv_cache, metadata = make_decode_batch(seq_lens, block_size=16, dtype=dtype)
    reference, native = backends(64, 16)
    expected = decode(native, query, kv_cache, metadata)
    owned = torch.zeros(kv_cache.shape[1], 16, dtype=torch.bool)
    for table, n in zip(metadata.decode_block_tables, seq_lens, strict=True):
        for position in range(n):
            owned[table[position // 16], position % 16] = True
    poisoned = kv_cache.clone()
    poisoned[:, ~owned] = float("nan")

    out = decode(native, query, poisoned, metadata)

    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float8_e5m2),
    ],
)
@pytest.mark.parametrize("window", [1, 7, 16, 40, 300])
def test_a_window_reads_the_last_tokens_only_like_the_torch_mask(
    window: int, dtype: torch.dtype, cache_dtype: torch.dtype, isa: str
) -> None:
    """A sliding-window layer's decode (Gemma 3's): the torch path's mask, on every variant and
    element type; the tokens before the window may hold anything (NaN here): never read."""
    query, kv_cache, metadata = make_decode_batch(SEQ_LENS, group=3, head_dim=64, block_size=16)
    query, kv_cache = query.to(dtype), kv_cache.to(cache_dtype)
    reference = TorchPagedAttention(16, 64**-0.5)
    native = NativePagedAttention(16, 64**-0.5, isa=isa)
    poisoned = kv_cache.clone()
    for table, n in zip(metadata.decode_block_tables, SEQ_LENS, strict=True):
        for position in range(max(0, n - window)):
            poisoned[:, table[position // 16], position % 16] = float("nan")

    out = native._decode(query, poisoned[0], poisoned[1], metadata, window)

    expected = reference._decode(query.float(), kv_cache[0], kv_cache[1], metadata, window)
    assert not out.isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    if window >= max(SEQ_LENS):  # a window past every context is no window
        whole = native._decode(query, kv_cache[0], kv_cache[1], metadata)
        torch.testing.assert_close(out, whole, atol=0, rtol=0)


@pytest.mark.usefixtures("kernel")
def test_nan_in_the_context_propagates_like_torch() -> None:
    query, kv_cache, metadata = make_decode_batch([20, 9], num_kv_heads=3, group=2)
    reference, native = backends(64, 16)
    # Key of token 17 of sequence 0, KV head 1: query heads 2 and 3 of that sequence see it.
    kv_cache[0, metadata.decode_block_tables[0, 1], 1, 1, 5] = float("nan")

    out = decode(native, query, kv_cache, metadata)

    expected = decode(reference, query, kv_cache, metadata)
    assert out[0, 2:4].isnan().all()
    assert torch.equal(out.isnan(), expected.isnan())


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("num_threads", [1, 3, 8])
def test_same_result_for_any_thread_count(num_threads: int) -> None:
    # Uneven lengths and fewer sequences than threads exercise the work split, which may give a
    # thread a run of KV heads instead of whole sequences.
    seq_lens = [300, 1, 7, 130]
    query, kv_cache, metadata = make_decode_batch(seq_lens, num_kv_heads=4, group=3)
    reference, native = backends(64, 16)
    with torch_threads(num_threads):
        out = decode(native, query, kv_cache, metadata)
        single = decode(native, query[:1], kv_cache, _first(metadata))

    torch.testing.assert_close(
        out, decode(reference, query, kv_cache, metadata), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(single, out[:1], atol=1e-6, rtol=1e-6)


def _first(metadata: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=metadata.slot_mapping,
        num_decodes=1,
        decode_block_tables=metadata.decode_block_tables[:1].contiguous(),
        decode_seq_lens=metadata.decode_seq_lens[:1].contiguous(),
        prefills=[],
    )


@pytest.mark.usefixtures("kernel")
def test_one_kv_head_and_a_long_context() -> None:
    query, kv_cache, metadata = make_decode_batch([2000, 3], num_kv_heads=1, group=4)
    reference, native = backends(64, 16)

    torch.testing.assert_close(
        decode(native, query, kv_cache, metadata),
        decode(reference, query, kv_cache, metadata),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_viewed_from_wider_rows_is_read_in_place(dtype: torch.dtype, isa: str) -> None:
    query, kv_cache, metadata = make_decode_batch(SEQ_LENS, group=3, head_dim=64, dtype=dtype)
    num_seqs, num_heads, head_dim = query.shape
    # As the fused QKV output holds it: each row's query heads, then the row's K and V (NaN
    # here, so that reading them would show).
    rows = torch.full((num_seqs, (num_heads + 4) * head_dim), float("nan"), dtype=dtype)
    strided = rows[:, : num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    strided.copy_(query)
    assert not strided.is_contiguous()
    op = torch.ops.pdserve.paged_decode_attention
    tables, lens = metadata.decode_block_tables, metadata.decode_seq_lens
    expected, actual = torch.empty_like(query), torch.empty_like(query)
    op(expected, query, kv_cache[0], kv_cache[1], tables, lens, 0.125, isa)
    op(actual, strided, kv_cache[0], kv_cache[1], tables, lens, 0.125, isa)
    assert torch.equal(actual, expected)


@pytest.mark.usefixtures("kernel")
def test_the_backend_hands_a_strided_query_over_without_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    query, kv_cache, metadata = make_decode_batch(SEQ_LENS, group=2, head_dim=64)
    num_seqs, num_heads, head_dim = query.shape
    rows = torch.zeros(num_seqs, (num_heads + 2) * head_dim)
    strided = rows[:, : num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    strided.copy_(query)
    _, native = backends(head_dim, 16)
    seen: list[torch.Tensor] = []
    real_op = torch.ops.pdserve.paged_decode_attention

    def recording(out: torch.Tensor, query: torch.Tensor, *args: object) -> None:
        seen.append(query)
        real_op(out, query, *args)

    monkeypatch.setattr(torch.ops.pdserve, "paged_decode_attention", recording)
    out = decode(native, strided, kv_cache, metadata)
    assert seen[0].data_ptr() == rows.data_ptr() and not seen[0].is_contiguous()
    assert out.is_contiguous()
    torch.testing.assert_close(out, decode(native, query, kv_cache, metadata), rtol=0, atol=0)
    # A layout the kernel cannot read in place is copied first, not refused.
    transposed = query.transpose(0, 1).contiguous().transpose(0, 1)
    torch.testing.assert_close(decode(native, transposed, kv_cache, metadata), out, rtol=0, atol=0)


@pytest.mark.usefixtures("kernel")
def test_rejects_bad_inputs() -> None:
    query, kv_cache, metadata = make_decode_batch([5, 20])
    op = torch.ops.pdserve.paged_decode_attention
    tables, lens = metadata.decode_block_tables, metadata.decode_seq_lens
    out = torch.empty_like(query)

    def call(**changes) -> None:
        args = {
            "out": out,
            "query": query,
            "key_cache": kv_cache[0],
            "value_cache": kv_cache[1],
            "block_tables": tables,
            "seq_lens": lens,
        }
        args.update(changes)
        op(*args.values(), 0.125, "portable")

    call()  # the unchanged arguments are fine
    with pytest.raises(RuntimeError, match="query must be float32 or bfloat16"):
        call(out=out.half(), query=query.half())
    with pytest.raises(RuntimeError, match="out must have query's dtype"):
        call(out=out.bfloat16())
    with pytest.raises(RuntimeError, match="key_cache must be float32, bfloat16 or float8_e5m2"):
        call(key_cache=kv_cache[0].half(), value_cache=kv_cache[1].half())
    with pytest.raises(RuntimeError, match="value_cache must have key_cache's dtype"):
        call(key_cache=kv_cache[0].bfloat16())
    # A cache of its own dtype (bf16 under an fp32 query) is a supported combination.
    call(key_cache=kv_cache[0].bfloat16(), value_cache=kv_cache[1].bfloat16())
    with pytest.raises(RuntimeError, match="query's rows must each be contiguous"):
        call(query=query.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(RuntimeError, match="query's rows must each be contiguous"):
        call(query=query.repeat_interleave(2, -1)[:, :, ::2])  # every other element
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        call(out=torch.empty(query.shape[0], query.shape[1] + 1, query.shape[2])[:, 1:])
    with pytest.raises(RuntimeError, match="not a multiple of num_kv_heads"):
        call(out=out[:, :5].contiguous(), query=query[:, :5].contiguous())
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] = 0"):
        call(seq_lens=torch.tensor([5, 0]))
    with pytest.raises(RuntimeError, match="outside"):
        call(seq_lens=torch.tensor([5, tables.shape[1] * 16 + 1]))
    bad_tables = tables.clone()
    bad_tables[1, 1] = kv_cache.shape[1]
    with pytest.raises(RuntimeError, match=r"block_tables\[1, 1\]"):
        call(block_tables=bad_tables)
    with pytest.raises(RuntimeError, match="int64"):
        call(seq_lens=lens.int())


@pytest.mark.usefixtures("kernel")
def test_llm_greedy_tokens_match_the_torch_backend(tiny_llama_dir: Path) -> None:
    prompts = [[5, 17, 300, 41], list(range(20, 70)), [7] * 33, [1000 + i for i in range(15)]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def generate(attention_backend: str) -> list[list[int]]:
        llm = LLM(
            tiny_llama_dir,
            dtype="float32",
            block_size=16,
            kv_cache_memory=4 << 20,
            attention_backend=attention_backend,
        )
        expected = NativePagedAttention if attention_backend == "native" else TorchPagedAttention
        assert type(llm.engine.runner.backend) is expected
        return [o.token_ids for o in llm.generate(prompts, params)]

    assert generate("native") == generate("torch")
