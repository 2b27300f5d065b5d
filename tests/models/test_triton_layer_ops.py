"""The fused Triton layer ops against ``LayerOps`` (torch), which gives transformers' numbers:
rotary and the residual add the same bits, RMSNorm and SiLU-and-mul within one rounding of the
dtype. On CPU the kernels run under Triton's interpreter (conftest sets it); ``gpu`` tests run
them compiled. Shapes include sizes that are not powers of two, and rotary works in place on
strided views of a fused QKV output, as the decoder hands them over."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.models.layer_ops import LayerOps
from services.models.rotary import RotaryEmbedding
from services.models.triton_layer_ops import TritonLayerOps

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter rounds float32 to bfloat16 toward zero (the GPU rounds to nearest even, as
# torch does), so bf16 is checked on a GPU only (``test_bfloat16_on_a_gpu``).
DTYPES = [torch.float32, torch.float16]
TORCH_OPS, TRITON_OPS = LayerOps(), TritonLayerOps()


def within_a_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    eps = torch.finfo(expected.dtype).eps
    # One rounding of the result, plus float32's own for a float32 result.
    bound = (expected.float().abs() * (eps if expected.dtype != torch.float32 else 8 * eps)) + 1e-6
    assert ((actual.float() - expected.float()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [128, 100])
@pytest.mark.parametrize("with_pending", [False, True])
def test_rms_norm_with_the_residual_add(dtype, hidden_size: int, with_pending: bool) -> None:
    gen = torch.Generator().manual_seed(hidden_size)
    hidden = torch.randn(5, hidden_size, generator=gen).to(DEVICE, dtype)
    pending = torch.randn(5, hidden_size, generator=gen).to(DEVICE, dtype) if with_pending else None
    weight = (1 + 0.1 * torch.randn(hidden_size, generator=gen)).to(DEVICE, dtype)
    ours_hidden, torch_hidden = hidden.clone(), hidden.clone()
    ours = TRITON_OPS.rms_norm(ours_hidden, pending, weight, 1e-6)
    expected = TORCH_OPS.rms_norm(torch_hidden, pending, weight, 1e-6)
    assert torch.equal(ours_hidden, torch_hidden)  # the residual add: the same bits, in place
    within_a_rounding(ours, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96])
def test_rotary_in_place_gives_the_same_bits(dtype, head_dim: int) -> None:
    num_tokens, num_heads, num_kv_heads = 6, 4, 2
    gen = torch.Generator().manual_seed(head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(DEVICE, dtype)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    rope.to_device(torch.device(DEVICE))
    tables = rope.tables(torch.tensor([0, 1, 7, 300, 2047, 4095], device=DEVICE), dtype)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
        )
        return q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)

    expected_q, expected_k = TORCH_OPS.rotary(*views(qkv.clone()), tables)
    ours = qkv.clone()
    q, k = TRITON_OPS.rotary(*views(ours), tables)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    # In place, and nothing outside the query and key moved (the values' columns).
    assert torch.equal(views(ours)[0], expected_q)
    assert torch.equal(ours[:, -num_kv_heads * head_dim :], qkv[:, -num_kv_heads * head_dim :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [256, 1500])
def test_silu_and_mul(dtype, intermediate: int) -> None:
    gen = torch.Generator().manual_seed(intermediate)
    gate_up = (3 * torch.randn(4, 2 * intermediate, generator=gen)).to(DEVICE, dtype)
    within_a_rounding(TRITON_OPS.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up))


@pytest.mark.gpu
def test_bfloat16_on_a_gpu() -> None:
    for hidden_size in (128, 100):
        for with_pending in (False, True):
            test_rms_norm_with_the_residual_add(torch.bfloat16, hidden_size, with_pending)
    for head_dim in (64, 96):
        test_rotary_in_place_gives_the_same_bits(torch.bfloat16, head_dim)
    for intermediate in (256, 1500):
        test_silu_and_mul(torch.bfloat16, intermediate)


def test_no_tokens() -> None:
    empty = torch.zeros(0, 64, device=DEVICE)
    assert TRITON_OPS.rms_norm(empty, None, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert TRITON_OPS.silu_and_mul(torch.zeros(0, 64, device=DEVICE)).shape == (0, 32)


def test_the_triton_backend_takes_them_when_asked(tiny_llama_dir, monkeypatch) -> None:
    """Greedy tokens through the whole model with the fused ops equal those with torch's (fp32,
    Triton attention), and the switch is what selects them: unset, the fused ops on a GPU and
    torch's under the interpreter; 0 and 1 either way; anything else refused by name."""
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 4096) for _ in range(n)] for n in (3, 20)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=64, kv_cache_memory=1 << 21,
                  attention_backend="triton", device=DEVICE)  # fmt: skip
    default = LLM(tiny_llama_dir, **kwargs).engine.runner.model.ops
    assert type(default) is (TritonLayerOps if DEVICE == "cuda" else LayerOps)
    monkeypatch.setenv("PDSERVE_TRITON_LAYER_OPS", "yes")
    with pytest.raises(ValueError, match="PDSERVE_TRITON_LAYER_OPS must be 0 or 1"):
        LLM(tiny_llama_dir, **kwargs)
    monkeypatch.setenv("PDSERVE_TRITON_LAYER_OPS", "0")
    plain = LLM(tiny_llama_dir, **kwargs)
    assert type(plain.engine.runner.model.ops) is LayerOps
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    monkeypatch.setenv("PDSERVE_TRITON_LAYER_OPS", "1")
    fused = LLM(tiny_llama_dir, **kwargs)
    assert isinstance(fused.engine.runner.model.ops, TritonLayerOps)
    assert [o.token_ids for o in fused.generate(prompts, params)] == expected
