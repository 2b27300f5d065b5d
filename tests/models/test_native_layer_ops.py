"""The fused native layer ops against torch's, on every kernel variant this CPU runs: rotary
the same bits; RMSNorm and SiLU-and-mul within a rounding of bf16 or a few ulps of fp32
(another summation order, another exp); the residual add exactly; the greedy argmax the same
index, ties, NaN and infinities included; the KV cache write index_copy_'s bits; bad arguments
a clear error."""

from __future__ import annotations

import pytest
import torch

from services.models.layer_ops import LayerOps
from services.models.native_build import native_kernel_error, supported_isas
from services.models.native_layer_ops import NativeLayerOps
from services.models.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]
TORCH = LayerOps()


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    error = native_kernel_error()
    if error is not None:
        pytest.skip(f"native CPU kernels unavailable: {error}")


@pytest.fixture(params=supported_isas())
def native(request: pytest.FixtureRequest) -> NativeLayerOps:
    return NativeLayerOps(request.param)


def ulps(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for another order of the same fp32 arithmetic: bf16 results are
    one rounding apart at most (the rounding hides fp32's last bits except next to a tie);
    float32 ones a few ulps (the kernels measured up to 2.8)."""
    eps = torch.finfo(dtype).eps
    rtol = eps if dtype == torch.bfloat16 else 4 * eps
    return {"rtol": rtol, "atol": rtol * 1e-2}


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_rotary_gives_torchs_bits_in_place_on_the_qkv_output(
    native: NativeLayerOps, dtype: torch.dtype, head_dim: int
) -> None:
    num_tokens, heads, kv_heads = 37, 6, 2
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(1))
    rope = rotary.tables(positions, dtype)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = randn(num_tokens, width, dtype=dtype, seed=head_dim)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = t[:, : heads * head_dim].view(num_tokens, heads, head_dim)
        k = t[:, heads * head_dim : (heads + kv_heads) * head_dim]
        return q, k.view(num_tokens, kv_heads, head_dim)

    expected_q, expected_k = TORCH.rotary(*split(qkv), rope)
    ours = qkv.clone()
    q, k = native.rotary(*split(ours), rope)

    assert q.data_ptr() == ours.data_ptr(), "rotated in place"
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(
        ours[:, (heads + kv_heads) * head_dim :], qkv[:, (heads + kv_heads) * head_dim :]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [768, 100])  # 100: a row that ends mid-vector
@pytest.mark.parametrize("with_pending", [False, True])
def test_rms_norm_with_the_residual_add(
    native: NativeLayerOps, dtype: torch.dtype, width: int, with_pending: bool
) -> None:
    hidden = randn(50, width, dtype=dtype, seed=width, scale=3.0)
    pending = randn(50, width, dtype=dtype, seed=width + 1) if with_pending else None
    weight = randn(width, dtype=dtype, seed=2)
    expected_hidden = hidden.clone()
    expected = TORCH.rms_norm(expected_hidden, pending, weight, 1e-5)

    ours_hidden = hidden.clone()
    ours = native.rms_norm(ours_hidden, pending, weight, 1e-5)

    assert torch.equal(ours_hidden, expected_hidden), "the residual add is torch's, in place"
    torch.testing.assert_close(ours, expected, **ulps(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2048, 100])
def test_silu_and_mul(native: NativeLayerOps, dtype: torch.dtype, width: int) -> None:
    # Wide enough to reach exp's clamps at both ends.
    gate_up = randn(33, 2 * width, dtype=dtype, seed=width, scale=40.0)
    expected = TORCH.silu_and_mul(gate_up.clone())
    ours = native.silu_and_mul(gate_up)
    torch.testing.assert_close(ours, expected, **ulps(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 3, 16, 17, 500, 32000])
def test_greedy_argmax_is_torchs_argmax_on_ties_nan_and_inf(
    native: NativeLayerOps, dtype: torch.dtype, width: int
) -> None:
    generator = torch.Generator().manual_seed(width)
    logits = torch.randint(-3, 4, (12, width), generator=generator).to(dtype)  # ties everywhere
    last = width - 1
    logits[3, last] = float("nan")  # in the scalar tail (or the only vector)
    logits[4, [last // 3, last]] = float("nan")  # the first NaN wins
    logits[5] = float("-inf")
    logits[6, width // 2 :] = float("inf")
    logits[7, last] = 10.0  # the maximum in the tail
    logits[8, 0] = float("nan")
    logits[9] = 1.0  # all equal: index 0
    expected = logits.argmax(dim=-1)
    assert torch.equal(TORCH.greedy_argmax(logits), expected)
    assert torch.equal(native.greedy_argmax(logits), expected)
    random = randn(64, width, dtype=dtype, seed=width)
    assert torch.equal(native.greedy_argmax(random), random.argmax(dim=-1))
    assert native.greedy_argmax(logits[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])  # 40 x 3 heads: rows that end mid-vector
def test_kv_cache_write_gives_index_copys_bits(
    native: NativeLayerOps, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int
) -> None:
    # K and V as the model hands them over: strided views of the fused QKV output.
    tokens, heads, blocks, block_size = 37, 3, 8, 16
    qkv = randn(tokens, (4 + 2) * heads * head_dim, dtype=torch.float32, seed=3, scale=3.0)
    # Round-to-even ties, NaN and infinities in the values rounded into bf16.
    qkv[0, 4 * heads * head_dim : 4 * heads * head_dim + 4] = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, float("nan"), float("-inf")]
    )
    qkv = qkv.to(dtype)
    key = qkv[:, 4 * heads * head_dim : 5 * heads * head_dim].view(tokens, heads, head_dim)
    value = qkv[:, 5 * heads * head_dim :].view(tokens, heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(4))
    slots = slots[:tokens].contiguous()
    cache = torch.full((2, blocks, block_size, heads, head_dim), -(2.0**20), dtype=cache_dtype)
    expected = cache.clone()
    for i, rows in enumerate((key, value)):
        flat = expected[i].view(-1, heads, head_dim)
        flat.index_copy_(0, slots, rows.to(cache_dtype))

    torch.ops.pdserve.write_kv_cache(cache[0], cache[1], key, value, slots, native.isa)

    # The same bits, but for a NaN's (torch's vectorised bf16 conversion makes it 0xffff, c10's
    # scalar one and ours 0x7fc0).
    bits = torch.int32 if cache_dtype == torch.float32 else torch.int16
    nan = expected.isnan()
    assert nan.sum() == 1 and torch.equal(cache.isnan(), nan)
    assert torch.equal(cache.view(bits)[~nan], expected.view(bits)[~nan])
    # Every other slot kept its -2^20.
    assert (cache == -(2.0**20)).sum() == 2 * (blocks * block_size - tokens) * heads * head_dim


def test_tensors_the_kernels_do_not_take_go_to_torch() -> None:
    native = NativeLayerOps()
    hidden = randn(4, 32, dtype=torch.float16, seed=0)
    weight = randn(32, dtype=torch.float16, seed=1)
    assert torch.equal(native.rms_norm(hidden.clone(), None, weight, 1e-5),
                       TORCH.rms_norm(hidden.clone(), None, weight, 1e-5))  # fmt: skip
    strided = randn(4, 64, dtype=torch.float32, seed=2)[:, ::2]  # not contiguous
    assert torch.equal(native.rms_norm(strided, None, weight.float(), 1e-5),
                       TORCH.rms_norm(strided, None, weight.float(), 1e-5))  # fmt: skip


def test_bad_arguments_are_errors_naming_them() -> None:
    isa = supported_isas()[0]
    hidden = torch.zeros(4, 32)
    with pytest.raises(RuntimeError, match="weight must be a contiguous \\[32\\]"):
        torch.ops.pdserve.rms_norm(
            hidden, None, torch.zeros(31), 1e-5, torch.empty_like(hidden), isa
        )
    with pytest.raises(RuntimeError, match="hidden must be float32 or bfloat16"):
        half = hidden.half()
        torch.ops.pdserve.rms_norm(half, None, torch.zeros(32).half(), 1e-5, half, isa)
    with pytest.raises(RuntimeError, match="gate_up must be a contiguous"):
        torch.ops.pdserve.silu_and_mul(torch.empty(4, 2), torch.zeros(4, 5), isa)
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        q = torch.zeros(2, 1, 5)
        torch.ops.pdserve.rotary_(q, q.clone(), torch.zeros(2, 5), torch.zeros(2, 5), isa)
    with pytest.raises(RuntimeError, match="logits must be a contiguous"):
        torch.ops.pdserve.argmax_rows(torch.zeros(4, 0), isa)
    with pytest.raises(RuntimeError, match="logits must be float32 or bfloat16"):
        torch.ops.pdserve.argmax_rows(torch.zeros(4, 8, dtype=torch.float16), isa)
    cache = torch.zeros(2, 4, 16, 2, 8)
    rows = torch.zeros(3, 2, 8)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 64 is outside the cache's 64"):
        torch.ops.pdserve.write_kv_cache(
            cache[0], cache[1], rows, rows, torch.tensor([0, 64, 1]), isa
        )
    with pytest.raises(RuntimeError, match="slot_mapping must be a contiguous int64 \\[3\\]"):
        torch.ops.pdserve.write_kv_cache(
            cache[0], cache[1], rows, rows, torch.tensor([0, 1, 2], dtype=torch.int32), isa
        )
    with pytest.raises(RuntimeError, match="key_cache must be a contiguous \\[num_blocks"):
        torch.ops.pdserve.write_kv_cache(
            cache[0, :, :, :1], cache[1, :, :, :1], rows, rows, torch.tensor([0, 1, 2]), isa
        )
    with pytest.raises(RuntimeError, match="value must be Float, got Double"):
        torch.ops.pdserve.write_kv_cache(
            cache[0], cache[1], rows, rows.double(), torch.tensor([0, 1, 2]), isa
        )
    with pytest.raises(RuntimeError, match="key must be \\[num_tokens, num_kv_heads, head_dim\\]"):
        torch.ops.pdserve.write_kv_cache(
            cache[0], cache[1], rows[:, :, ::2], rows[:, :, ::2], torch.tensor([0, 1, 2]), isa
        )
    with pytest.raises(RuntimeError, match="unknown or unavailable kernel variant 'sse9'"):
        torch.ops.pdserve.silu_and_mul(torch.empty(4, 2), torch.zeros(4, 4), "sse9")
