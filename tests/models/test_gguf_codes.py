"""A GGUF file's quantized projections stay int8 codes on a CPU (``gguf_blocks``,
``gguf_linear``, ``csrc/quantized_linear.cpp``): the codes give back the gguf package's
dequantized floats bit for bit in every format kept, the kernel computes on them what the fp32
few-row kernel computes on the dequantized weight (bit for bit, every variant this CPU runs),
fused projections of mixed formats hold each part, and an engine on a quantized file generates
what it generates with every weight dequantized, in a fraction of the memory."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file

from services.engine import LLM, SamplingParams
from services.models import gguf_linear
from services.models.fp32_linear import Fp32FewRowWeight, fp32_linear_unavailable_reason
from services.models.gguf_blocks import CODE_TYPES, GgufBlocks, decode_blocks, group_size
from services.models.gguf_linear import (
    SWITCH_ENV,
    GgufEmbedding,
    GgufLinear,
    gguf_codes_unavailable_reason,
)
from services.models.model_file_error import ModelFileError
from services.models.native_build import ISA_ENV, supported_isas
from support.gguf_files import gguf_source, round_trip_dir

PROMPTS = [[0, 17, 230, 4000, 9, 88, 1024], [0, 5], [3000, 2999, 12, 12, 12, 7, 1, 64, 900, 33, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
_AFFINE = (
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
)


@pytest.fixture(autouse=True)
def kernels() -> None:
    reason = gguf_codes_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"GGUF weights are dequantized here: {reason}")


def random_raw(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """``[rows, row bytes]`` of random blocks of ``qtype``: every byte random but the fp16
    scales (d, and dmin or m), which are kept finite and small as a real file's are."""
    rng = np.random.default_rng(seed)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_size * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)

    def halves() -> np.ndarray:
        return rng.uniform(-0.05, 0.05, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)

    if qtype == GGMLQuantizationType.Q6_K:
        blocks[:, -2:] = halves()  # d comes last
    else:
        blocks[:, 0:2] = halves()
        if qtype in _AFFINE:
            blocks[:, 2:4] = halves()
    return raw


def blocks_of(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> GgufBlocks:
    return decode_blocks(random_raw(qtype, rows, cols, seed), qtype, cols)


@pytest.mark.parametrize("qtype", sorted(CODE_TYPES, key=lambda t: t.name))
def test_codes_give_back_the_gguf_packages_floats_bit_for_bit(
    qtype: GGMLQuantizationType,
) -> None:
    rows, cols = 6, 3 * GGML_QUANT_SIZES[qtype][0]
    raw = random_raw(qtype, rows, cols, seed=1)
    blocks = decode_blocks(raw, qtype, cols)
    assert blocks.codes.dtype == torch.int8 and blocks.group == group_size(qtype)
    assert (blocks.offsets is not None) == (qtype in _AFFINE)
    expected = quants.dequantize(raw, qtype).reshape(rows, cols)
    assert np.array_equal(blocks.dequantize().numpy().view(np.int32), expected.view(np.int32))
    # Regrouped (a fused projection's finest group, offsets where a part has them): the same
    # values (a zero offset turns a -0.0 into +0.0).
    assert torch.equal(blocks.regrouped(16, with_offsets=True).dequantize(), blocks.dequantize())


def module_of(
    parts: list[GgufBlocks], bias: torch.Tensor | None = None, bits: int = 8
) -> GgufLinear:
    """A ``GgufLinear`` holding ``parts`` one after another, grouped and offset as the
    installer does it for a fused projection (``bits`` 4: every part of a 4-bit format)."""
    out_features = sum(part.shape[0] for part in parts)
    module = GgufLinear(
        parts[0].shape[1],
        out_features,
        bias=bias is not None,
        group=min(part.group for part in parts),
        offsets=bits == 4 or any(part.offsets is not None for part in parts),
        bits=bits,
    )
    row = 0
    for part in parts:
        module.fill(row, part)
        row += part.shape[0]
    if bias is not None:
        assert module.bias is not None
        module.bias.data.copy_(bias)
    module.pack()
    return module


# A Q4_K_M file's fused QKV: Q and K in Q4_K (offsets, 32 a group), V in Q6_K (16 a group): 8-bit
# codes. A Q4_0 / Q4_1 file's (and Q4_K_M's other half): every part 4-bit, two codes a byte.
MIXED = {
    8: (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K),
    4: (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1),
}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("num_rows", [1, 5, 6, 16, 17, 64, 130, 400])  # 400: 9 chunks of 48
def test_the_kernel_computes_the_fp32_kernels_sums_on_the_dequantized_weight(
    bits: int, isa: str, num_rows: int
) -> None:
    kinds = MIXED[bits]
    parts = [
        blocks_of(kinds[0], 128, 512, seed=2),
        blocks_of(kinds[1], 64, 512, seed=3),
        blocks_of(kinds[2], 64, 512, seed=4),
    ]
    bias = torch.randn(256, generator=torch.Generator().manual_seed(5))
    module = module_of(parts, bias, bits)
    assert module.codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
    module.isa = isa
    weight = torch.cat([part.dequantize() for part in parts])
    assert torch.equal(module.dequantized(), weight)
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(6))
    out = module(x)
    expected = F.linear(x.double(), weight.double(), bias.double())
    # fp32 sums of 512 products: within a few float32 epsilons of the sum of their magnitudes.
    magnitude = x.abs().double() @ weight.abs().double().T + bias.abs().double()
    assert ((out.double() - expected).abs() <= 1e-6 * magnitude).all()
    if fp32_linear_unavailable_reason() is None:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        few_rows = Fp32FewRowWeight.of(weight, packed)
        if few_rows is not None:  # oneDNN packed it in the kernel's panels on this CPU
            few_rows = Fp32FewRowWeight(
                packed, few_rows.address, 512, 256, isa if isa != "portable" else "avx2"
            )
            if isa != "portable":  # the portable variant sums in 4 lanes, not 8 or 16
                assert torch.equal(out, few_rows.linear(x, bias))  # values: -0.0 == 0.0


@pytest.mark.parametrize(("scratch_panels", "bits"), [(None, 8), (2, 8), (2, 4)])
def test_a_prefill_chunk_multiplies_the_dequantized_weight_with_torchs_gemm(
    scratch_panels: int | None, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``GEMM_ROWS`` rows the weight is dequantized into the thread's scratch (a slice of
    panels at a time where it would not fit) and multiplied by torch's GEMM."""
    kinds = (
        (GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q8_0)
        if bits == 8
        else (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_0)
    )
    parts = [blocks_of(kinds[0], 192, 256, seed=11), blocks_of(kinds[1], 128, 256, seed=12)]
    bias = torch.randn(320, generator=torch.Generator().manual_seed(13))
    module = module_of(parts, bias, bits)
    if scratch_panels is not None:
        monkeypatch.setattr(gguf_linear, "SCRATCH_FLOATS", scratch_panels * 256 * 64)
    x = torch.randn(gguf_linear.GEMM_ROWS + 3, 256, generator=torch.Generator().manual_seed(14))
    weight = torch.cat([part.dequantize() for part in parts])
    expected = F.linear(x.double(), weight.double(), bias.double())
    magnitude = x.abs().double() @ weight.abs().double().T + bias.abs().double()
    assert ((module(x).double() - expected).abs() <= 1e-6 * magnitude).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_the_weights_transpose_is_written_panel_by_panel(bits: int) -> None:
    module = module_of([blocks_of(GGMLQuantizationType.Q4_K, 256, 256, seed=15)], bits=bits)
    op = torch.ops.pdserve.quantized_weight_t
    args = (module.codes, module.scales, module.offsets, module.group, bits)
    out = torch.full((256, 128), float("nan"))
    op(*args, 1, 3, out, module.isa)
    assert torch.equal(out, module.dequantized()[64:192].T)
    with pytest.raises(RuntimeError, match="panels must be a range within \\[0, 4\\)"):
        op(*args, 3, 5, torch.empty(256, 128), module.isa)
    with pytest.raises(RuntimeError, match="out must be \\[256, 128\\]"):
        op(*args, 1, 3, torch.empty(256, 64), module.isa)
    with pytest.raises(RuntimeError, match="out must be float32"):
        op(*args, 1, 3, torch.empty(256, 128, dtype=torch.float64), module.isa)


def test_bf16_rows_come_back_bf16() -> None:
    module = module_of([blocks_of(GGMLQuantizationType.Q8_0, 64, 64, seed=7)])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    out = module(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, module(x.bfloat16().float()).bfloat16())


def test_bad_arguments_are_errors_that_name_them() -> None:
    module = module_of([blocks_of(GGMLQuantizationType.Q4_1, 64, 64, seed=9)])
    op = torch.ops.pdserve.quantized_linear
    x = torch.randn(2, 64)
    codes, scales, offsets = module.codes, module.scales, module.offsets
    with pytest.raises(RuntimeError, match="x must be \\[num_rows, 64\\]"):
        op(torch.randn(2, 32), codes, scales, offsets, 32, 8, None, module.isa)
    with pytest.raises(RuntimeError, match="x must be float32"):
        op(x.double(), codes, scales, offsets, 32, 8, None, module.isa)
    with pytest.raises(RuntimeError, match="group must divide 64"):
        op(x, codes, scales, offsets, 48, 8, None, module.isa)
    with pytest.raises(RuntimeError, match="scales must be \\[1, 4, 64\\]"):
        op(x, codes, scales, offsets, 16, 8, None, module.isa)
    with pytest.raises(RuntimeError, match="offsets must be float32"):
        op(x, codes, scales, offsets.double(), 32, 8, None, module.isa)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="codes must be int8"):
        op(x, codes.float(), scales, offsets, 32, 8, None, module.isa)
    with pytest.raises(RuntimeError, match="bias must be \\[64\\]"):
        op(x, codes, scales, offsets, 32, 8, torch.zeros(3), module.isa)
    with pytest.raises(RuntimeError, match="bits must be 8, or 4 with offsets, got 3"):
        op(x, codes, scales, offsets, 32, 3, None, module.isa)
    with pytest.raises(RuntimeError, match="bits must be 8, or 4 with offsets, got 4"):
        op(x, codes, scales, None, 32, 4, None, module.isa)
    with pytest.raises(RuntimeError, match="codes must be uint8"):
        op(x, codes.view(2, 32, 64), scales, offsets, 32, 4, None, module.isa)
    with pytest.raises(ValueError, match="4-bit ones with offsets"):
        GgufLinear(64, 64, bias=False, group=32, offsets=False, bits=4)
    with pytest.raises(RuntimeError, match="sse9"):
        op(x, codes, scales, offsets, 32, 8, None, "sse9")
    assert op(x[:0], codes, scales, offsets, 32, 8, None, module.isa).shape == (0, 64)


def test_the_switch_and_a_gpu_dequantize(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gguf_codes_unavailable_reason(torch.device("cuda")) == "no kernel for them on cuda"
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert gguf_codes_unavailable_reason(torch.device("cpu")) == f"{SWITCH_ENV}=0"
    monkeypatch.setenv(SWITCH_ENV, "1")
    monkeypatch.setenv(ISA_ENV, "sse9")
    assert "sse9" in str(gguf_codes_unavailable_reason(torch.device("cpu")))  # said, not raised
    monkeypatch.delenv(ISA_ENV)
    monkeypatch.setattr(gguf_linear, "native_kernel_error", lambda: "no compiler")
    assert gguf_codes_unavailable_reason(torch.device("cpu")) == (
        "native CPU kernels are unavailable: no compiler"
    )


def gguf_llm(path: Path) -> LLM:
    return LLM(path, dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)


def code_modules(llm: LLM) -> dict[str, GgufLinear]:
    return {
        name: module
        for name, module in llm.engine.runner.model.named_modules()
        if isinstance(module, GgufLinear)
    }


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [
        ("llama", "Q8_0"),
        ("llama", "Q4_1"),
        ("llama", "Q5_1"),
        ("qwen2", "Q4_0"),
        ("qwen2", "Q5_0"),
        ("phi3", "Q8_0"),
        ("gemma3", "Q4_0"),
        ("qwen3_moe", "Q8_0"),  # a dense layer among the experts'
        ("olmoe", "Q4_0"),
        ("mixtral", "Q4_1"),
    ],
)
def test_an_engine_on_codes_generates_what_it_does_dequantized(
    arch: str, qtype: str, tiny_gguf_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_gguf_factory(arch, qtype)
    llm = gguf_llm(path)
    modules = code_modules(llm)
    config = llm.engine.runner.model_config
    layers, moe = config.num_layers, len(config.moe_layers)
    # qkv and o of every layer, gate_up and down of every dense layer and of every expert; the
    # embedding's table and the lm_head (tied: one).
    projections = 2 * layers + 2 * (layers - moe) + 2 * config.num_experts * moe
    assert sum(".layers." in name for name in modules) == projections
    model = llm.engine.runner.model
    for index in config.moe_layers:  # the experts' stacked parameters gave way to the codes
        assert not hasattr(model.model.layers[index].mlp, "experts_gate_up")
    assert isinstance(model.model.embed_tokens, GgufEmbedding)
    assert isinstance(model.lm_head, GgufLinear)
    tied = llm.engine.runner.model_config.tie_word_embeddings
    assert (model.lm_head is model.model.embed_tokens.table) == tied
    assert len(modules) == projections + (1 if tied else 2)
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    code_bytes = sum(m.nbytes for m in modules.values())
    del llm
    monkeypatch.setenv(SWITCH_ENV, "0")
    plain = gguf_llm(path)
    assert not code_modules(plain)
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == got
    # fp32 weights: 4 bytes each; codes 1 (two a byte: 4-bit), plus 4 bytes of scales a group
    # of 32 and 4 of offsets (Q4_0's too once its codes are 4-bit: -8 d).
    weights = sum(m.in_features * m.out_features for m in modules.values())
    nibbles = qtype in ("Q4_0", "Q4_1")
    per_weight = 0.5 + 8 / 32 if nibbles else 1 + (8 if qtype == "Q5_1" else 4) / 32
    assert {m.bits for m in modules.values()} == {4 if nibbles else 8}
    assert code_bytes == pytest.approx(weights * per_weight)


def test_codes_hold_the_checkpoints_rows_unpermuted_and_fused(
    tiny_gguf_factory, tmp_path: Path
) -> None:
    """Each projection's dequantized codes are the original checkpoint's weights after the same
    quantization round trip: llama.cpp's Q/K row permutation undone, Q, K and V (gate and up)
    each in its own rows."""
    path = tiny_gguf_factory("llama", "Q4_0")
    reference = load_file(
        round_trip_dir(gguf_source(path), "Q4_0", tmp_path / "ref") / "model.safetensors"
    )
    llm = gguf_llm(path)
    modules = code_modules(llm)
    embedding = llm.engine.runner.model.model.embed_tokens
    table = reference["model.embed_tokens.weight"]
    assert torch.equal(embedding(torch.arange(table.shape[0])), table)
    assert torch.equal(embedding(torch.tensor([5, 0, 5])), table[[5, 0, 5]])
    assert torch.equal(modules["lm_head"].dequantized(), reference["lm_head.weight"])
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        expected = {
            "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn.o_proj": ("self_attn.o_proj",),
            "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp.down_proj": ("mlp.down_proj",),
        }
        for ours, theirs in expected.items():
            weight = torch.cat([reference[f"{prefix}.{name}.weight"] for name in theirs])
            assert torch.equal(modules[f"{prefix}.{ours}"].dequantized(), weight), ours


def test_unquantized_projections_stay_dense(tiny_gguf_factory) -> None:
    """An F16 file holds no codes: every weight is dequantized (converted) as before."""
    assert not code_modules(gguf_llm(tiny_gguf_factory("llama", "F16")))


def test_a_quantized_weight_of_the_wrong_shape_is_named(
    tiny_model_factory, gguf_converter, tmp_path: Path
) -> None:
    source = Path(shutil.copytree(tiny_model_factory("llama"), tmp_path / "hf"))
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors = load_file(source / "model.safetensors")
    tensors[name] = tensors[name][:64].contiguous()  # 64 of its 128 rows
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    path = gguf_converter(source, tmp_path / "cut.Q8_0.gguf", "Q8_0")
    with pytest.raises(ModelFileError, match=rf"{name.replace('.', '[.]')}.*shape \(64, 128\)"):
        gguf_llm(path)


def test_lora_adapters_on_codes_add_to_what_the_dequantized_engine_does(
    tiny_gguf_factory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A PEFT adapter on a GGUF base wraps the projections that hold codes as it wraps any:
    each request's greedy ids equal those of the dequantized engine with the same adapter."""
    from services.engine import LoRARequest
    from support.lora_adapter import write_adapter

    path = tiny_gguf_factory("llama", "Q4_0")
    write_adapter(tmp_path / "adapter", gguf_source(path), std=0.05)
    adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2]]
    requests = [adapter, None, adapter]

    def greedy_ids() -> tuple[list[list[int]], int]:
        llm = LLM(path, dtype="float32", max_model_len=64, kv_cache_memory=1 << 20,
                  enable_lora=True, max_lora_rank=4)  # fmt: skip
        outputs = llm.generate(prompts, GREEDY, lora_request=requests, use_tqdm=False)
        return [o.token_ids for o in outputs], len(code_modules(llm))

    with_codes, modules = greedy_ids()
    assert modules > 0
    monkeypatch.setenv(SWITCH_ENV, "0")
    dequantized, none = greedy_ids()
    assert none == 0
    assert with_codes == dequantized
    # The adapter changes what the base model says (so the comparison covers its deltas).
    assert with_codes[0] != with_codes[1]
