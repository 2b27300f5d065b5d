"""fp8 checkpoints and fp8 projections: ``fp8_checkpoint.py``, ``fp8_linear.py``, the loader.

Each fp8 checkpoint is written from the tiny model with a reference beside it: the 16-bit
checkpoint of exactly the values the fp8 one stores. Loaded dequantized (a CPU's default), the
fp8 checkpoint must give that reference's logits bit for bit; loaded into fp8 projections it
must keep the checkpoint's fp8 values unchanged, and each projection must compute what its two
quantized operands make (the GEMM's only error is its input's quantization).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from services.engine import LLM, LoRARequest, SamplingParams
from services.models import ModelFileError
from services.models.attention import TorchPagedAttention
from services.models.config import ModelConfig
from services.models.fp8_checkpoint import (
    FP8_MAX,
    Fp8Checkpoint,
    quantize_rows,
    read_fp8_checkpoint,
)
from services.models.fp8_linear import (
    Fp8Linear,
    choose_fp8_linears,
    fp8_gemm_unavailable_reason,
    quantize_input_torch,
)
from services.models.llama import LlamaForCausalLM
from services.models.loader import load_model
from services.types import EngineConfigError
from support.fp8_checkpoints import STATIC_INPUT_SCALE, write_fp8_checkpoint
from support.lora_adapter import write_adapter
from support.prefill_logits import prefill_logits

PROMPT = [0, 17, 230, 4000, 9, 88, 1024, 5, 77]
SCHEMES = [
    # (method, weight strategy, activations)
    ("compressed-tensors", "channel", "dynamic"),
    ("compressed-tensors", "tensor", "static"),
    ("compressed-tensors", "block", "none"),
    ("fp8", "tensor", "dynamic"),
    ("fp8", "tensor", "static"),
    ("fp8", "block", "dynamic"),
]


def load(model_dir: Path, *, fp8_linears: bool = False) -> LlamaForCausalLM:
    config = ModelConfig.from_model_dir(model_dir)
    return load_model(
        model_dir,
        config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_positions=64,
        backend=TorchPagedAttention(4, scale=1.0 / math.sqrt(config.head_dim)),
        fp8_linears=fp8_linears,
    )


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def checkpoints(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str, str], tuple[Path, Path]]:
    """(method, strategy, activations) → (fp8 checkpoint, its 16-bit reference)."""
    out = tmp_path_factory.mktemp("fp8")
    return {
        scheme: write_fp8_checkpoint(
            tiny_llama_dir,
            out / "-".join(scheme),
            method=scheme[0],
            strategy=scheme[1],
            activations=scheme[2],
        )
        for scheme in SCHEMES
    }


@pytest.mark.parametrize("scheme", SCHEMES, ids="-".join)
def test_dequantized_load_equals_the_reference(
    checkpoints: dict[tuple[str, str, str], tuple[Path, Path]], scheme: tuple[str, str, str]
) -> None:
    fp8_dir, ref_dir = checkpoints[scheme]
    model = load(fp8_dir)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    assert torch.equal(prefill_logits(model, PROMPT), prefill_logits(load(ref_dir), PROMPT))


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s[1] != "block"], ids="-".join)
def test_fp8_projections_keep_the_checkpoint_values(
    checkpoints: dict[tuple[str, str, str], tuple[Path, Path]], scheme: tuple[str, str, str]
) -> None:
    fp8_dir, ref_dir = checkpoints[scheme]
    model = load(fp8_dir, fp8_linears=True)
    stored = load_file(fp8_dir / "model.safetensors")
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear) and isinstance(attn.o_proj, Fp8Linear)
    q_rows = stored["model.layers.1.self_attn.q_proj.weight"].shape[0]
    # The fused weight's first rows are q_proj's fp8 values, bit for bit (compared as bytes).
    assert torch.equal(
        attn.qkv_proj.weight[:q_rows].view(torch.uint8),
        stored["model.layers.1.self_attn.q_proj.weight"].view(torch.uint8),
    )
    reference = load(ref_dir)
    ref_attn = reference.model.layers[1].self_attn
    dequantized = attn.qkv_proj.weight.float() * attn.qkv_proj.weight_scale[:, None]
    torch.testing.assert_close(dequantized, ref_attn.qkv_proj.weight, rtol=1e-6, atol=0)
    if scheme[2] == "static":
        assert attn.qkv_proj.input_scale == pytest.approx(STATIC_INPUT_SCALE)
    else:
        assert attn.qkv_proj.input_scale is None
    # Whole model: the activations' quantization is the only difference from the reference.
    assert relative_error(prefill_logits(model, PROMPT), prefill_logits(reference, PROMPT)) < 0.15


def test_an_fp8_projection_computes_its_quantized_operands_product() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    linear = Fp8Linear(64, 96, bias=True)
    linear.fill(0, quantize_rows(weight))
    linear.bias.data.copy_(bias)
    x = torch.randn(5, 64) * torch.tensor([[0.01], [1.0], [30.0], [0.5], [2.0]])
    x[3] = 0.0  # a row of zeros: its scale is clamped, its output the bias
    # What the GEMM must give: both operands rounded to fp8 by their row scales, products in fp32.
    x_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q_x = (x / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    q_w = linear.weight.float() * linear.weight_scale[:, None]
    torch.testing.assert_close(linear(x), q_x @ q_w.t() + bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x)[3], bias)
    # Per row: one row's large values do not take another row's precision.
    assert relative_error(linear(x)[0:1] - bias, (x[0:1] @ weight.t())) < 0.08
    assert linear(x[:0]).shape == (0, 96)
    linear.input_scale = 0.05  # static: every row by the same scale, values past it saturate
    q_static = (x / 0.05).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * 0.05
    torch.testing.assert_close(linear(x), q_static @ q_w.t() + bias, rtol=1e-5, atol=1e-5)


def triton_device(device: str) -> None:
    """The Triton kernels run on ``device``: CPU tensors only under the interpreter (the
    conftest sets it where there is no GPU)."""
    pytest.importorskip("triton")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs CPU tensors under TRITON_INTERPRET=1 only")


TRITON_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("static_scale", [None, 0.05])
@pytest.mark.parametrize("cols", [96, 20000])  # one block, and a row wider than a block
def test_the_triton_input_quantization_gives_the_torch_paths_bits(
    cols: int, static_scale: float | None, device: str
) -> None:
    triton_device(device)
    from services.models.triton_fp8_quant import quantize_input_triton

    generator = torch.Generator().manual_seed(cols)
    x = torch.randn(3, cols, generator=generator) * torch.tensor([[1e-3], [1.0], [300.0]])
    x[1, cols - 1] = 9.0  # the row's largest value in its last block
    x = x.to(device)
    q, scale = quantize_input_triton(x, static_scale)
    want_q, want_scale = quantize_input_torch(x, static_scale)
    assert torch.equal(scale, want_scale)
    if device == "cuda":
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        return
    # Triton's interpreter converts to fp8 by truncating the mantissa (and drops the carry where
    # a value rounds up into the next binade: -126.8 gives -64, not -128), so on a CPU each value
    # is checked to within one e4m3 step, the carries apart; the GPU's conversion rounds to
    # nearest even, and its run of this test compares bits.
    got, want = q.float(), want_q.float()
    carried = (want.abs().log2().frac() == 0) & (got == want / 2)
    step = torch.maximum(want.abs() * 2**-3, torch.tensor(2.0**-9))  # an ulp; subnormals' 2**-9
    assert ((got - want).abs() <= step)[~carried].all()
    assert (got.abs() <= FP8_MAX).all()


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_triton_output_scaling_gives_the_torch_paths_numbers(
    with_bias: bool, device: str
) -> None:
    """raw sums x row scales x column scales (+ bias), in float32 (the interpreter rounds to
    16-bit types toward zero, so the output is float32 here)."""
    triton_device(device)
    from services.models.triton_fp8_quant import scale_output_triton

    generator = torch.Generator().manual_seed(7)
    raw = (torch.randn(3, 2500, generator=generator) * 1e4).to(torch.bfloat16).to(device)
    x_scale = torch.rand(3, 1, generator=generator).to(device) * 1e-2
    w_scale = torch.rand(2500, generator=generator).to(device) * 1e-3
    bias = torch.randn(2500, generator=generator).to(device) if with_bias else None
    got = scale_output_triton(raw, x_scale, w_scale, bias, torch.float32)
    want = raw.float() * x_scale * w_scale + (0 if bias is None else bias)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_quantize_rows_keeps_each_row_within_fp8_rounding() -> None:
    weight = torch.randn(32, 48) * torch.logspace(-3, 2, 32)[:, None]
    quantized = quantize_rows(weight)
    assert quantized.values.dtype == torch.float8_e4m3fn
    assert quantized.values.float().abs().amax(dim=1).eq(FP8_MAX).all()
    # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 of the value (normal range).
    error = (quantized.dequantize() - weight).abs()
    assert (error <= weight.abs() * 2**-4 + quantized.row_scales[:, None] * 2**-9).all()


def test_online_quantization_of_a_16_bit_checkpoint(tiny_llama_dir: Path) -> None:
    model = load(tiny_llama_dir, fp8_linears=True)
    reference = load(tiny_llama_dir)
    projections = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(projections) == 4 * len(model.model.layers)
    assert type(model.lm_head) is nn.Linear  # the lm_head stays in the compute dtype
    ref_down = reference.model.layers[0].mlp.down_proj.weight
    down = model.model.layers[0].mlp.down_proj
    torch.testing.assert_close(
        down.weight.float() * down.weight_scale[:, None], ref_down, rtol=2**-4, atol=1e-6
    )
    assert relative_error(prefill_logits(model, PROMPT), prefill_logits(reference, PROMPT)) < 0.15


def test_modules_the_checkpoint_leaves_in_16_bits_stay_so(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    fp8_dir, ref_dir = write_fp8_checkpoint(
        tiny_llama_dir, tmp_path, ignore=("lm_head", "model.layers.0.mlp.down_proj")
    )
    model = load(fp8_dir, fp8_linears=True)
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[1].mlp.down_proj, Fp8Linear)
    assert torch.equal(
        model.model.layers[0].mlp.down_proj.weight,
        load(ref_dir).model.layers[0].mlp.down_proj.weight,
    )


def test_a_weight_without_its_scale_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    fp8_dir, _ = write_fp8_checkpoint(tiny_llama_dir, tmp_path)
    tensors = load_file(fp8_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, fp8_dir / "model.safetensors")
    with pytest.raises(ModelFileError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load(fp8_dir)


def test_kv_cache_scales_beside_the_weights_are_passed_over(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    fp8_dir, ref_dir = write_fp8_checkpoint(tiny_llama_dir, tmp_path)
    tensors = load_file(fp8_dir / "model.safetensors")
    for layer in range(2):  # llm-compressor's kv_cache_scheme, and AutoFP8's output scales
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.1)
        tensors[f"model.layers.{layer}.self_attn.v_proj.output_scale"] = torch.tensor([0.2])
    save_file(tensors, fp8_dir / "model.safetensors")
    assert torch.equal(prefill_logits(load(fp8_dir), PROMPT), prefill_logits(load(ref_dir), PROMPT))


def test_fp8_weights_without_a_quantization_config_are_refused(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    fp8_dir, _ = write_fp8_checkpoint(tiny_llama_dir, tmp_path)
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=r"float8_e4m3fn without a scale"):
        load(fp8_dir)


def test_a_misshapen_scale_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    fp8_dir, _ = write_fp8_checkpoint(tiny_llama_dir, tmp_path)
    tensors = load_file(fp8_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight_scale"] = torch.ones(3, 1)
    save_file(tensors, fp8_dir / "model.safetensors")
    with pytest.raises(ModelFileError, match=r"o_proj\.weight_scale has shape \(3, 1\)"):
        load(fp8_dir)


def _with_quantization(model_dir: Path, tmp_path: Path, quantization: object) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    ("quantization", "error", "match"),
    [
        ({"quant_method": "awq", "bits": 4}, EngineConfigError, "quant_method 'awq'"),
        ({"quant_method": "gptq"}, EngineConfigError, "quant_method 'gptq'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}},
            },
            EngineConfigError,
            "format 'int-quantized'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "naive-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}
                },
            },
            EngineConfigError,
            "4-bit int",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128]},
            ModelFileError,
            "weight_block_size must be two positive integers",
        ),
        ({"quant_method": "fp8", "activation_scheme": "sometimes"}, ModelFileError, "dynamic"),
        ("fp8", ModelFileError, "not a JSON object"),
    ],
)
def test_quantizations_pdserve_does_not_load_are_named(
    tiny_llama_dir: Path, tmp_path: Path, quantization: object, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        read_fp8_checkpoint(_with_quantization(tiny_llama_dir, tmp_path, quantization))


def test_schemes_are_read_from_both_formats(
    checkpoints: dict[tuple[str, str, str], tuple[Path, Path]], tiny_llama_dir: Path
) -> None:
    assert read_fp8_checkpoint(tiny_llama_dir) is None
    read = {s: read_fp8_checkpoint(checkpoints[s][0]) for s in SCHEMES}
    assert read[("fp8", "block", "dynamic")] == Fp8Checkpoint(
        method="fp8", weights="block", block=(32, 64), activations="dynamic", ignored=("lm_head",)
    )
    assert read[("compressed-tensors", "block", "none")] == Fp8Checkpoint(
        method="compressed-tensors",
        weights="block",
        block=(32, 64),
        activations="none",
        ignored=("lm_head",),
    )
    channel = read[("compressed-tensors", "channel", "dynamic")]
    assert channel is not None and (channel.weights, channel.activations) == ("channel", "dynamic")
    assert channel.is_ignored("lm_head") and not channel.is_ignored("model.layers.0.mlp.up_proj")
    pattern = Fp8Checkpoint("compressed-tensors", "channel", None, "dynamic", (r"re:.*\.0\..*",))
    assert pattern.is_ignored("model.layers.0.mlp.up_proj")
    assert not pattern.is_ignored("model.layers.10.mlp.up_proj")


def test_fp8_projections_are_chosen_where_they_pay(
    checkpoints: dict[tuple[str, str, str], tuple[Path, Path]],
) -> None:
    cpu = torch.device("cpu")
    channel = read_fp8_checkpoint(checkpoints[("compressed-tensors", "channel", "dynamic")][0])
    block = read_fp8_checkpoint(checkpoints[("fp8", "block", "dynamic")][0])
    assert not choose_fp8_linears(None, None, cpu).on
    assert not choose_fp8_linears(None, channel, cpu).on  # dequantized: no faster fp8 GEMM here
    assert choose_fp8_linears("fp8", None, cpu).on
    assert choose_fp8_linears("fp8", block, cpu).on
    assert "block" in choose_fp8_linears(None, block, cpu).why


def test_the_engine_runs_fp8_checkpoints_and_online_fp8(
    checkpoints: dict[tuple[str, str, str], tuple[Path, Path]], tiny_llama_dir: Path
) -> None:
    fp8_dir, ref_dir = checkpoints[("compressed-tensors", "channel", "dynamic")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:4]}]

    def tokens(model: Path, **kwargs: object) -> list[list[int]]:
        llm = LLM(model, dtype="float32", kv_cache_memory=8 << 20, **kwargs)  # type: ignore[arg-type]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    # On a CPU an fp8 checkpoint is dequantized: the reference's tokens exactly.
    assert tokens(fp8_dir) == tokens(ref_dir)
    # fp8 projections, dynamic and on the static decode path (eager on a CPU): one answer.
    online = tokens(tiny_llama_dir, quantization="fp8")
    assert tokens(tiny_llama_dir, quantization="fp8", cuda_graphs=True) == online
    assert all(len(t) == 12 for t in online)
    with pytest.raises(EngineConfigError, match="quantization must be fp8 or None"):
        LLM(tiny_llama_dir, quantization="awq")


def need_fp8_gemm() -> None:
    reason = fp8_gemm_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
def test_an_fp8_projection_on_cuda_computes_its_quantized_operands_product() -> None:
    need_fp8_gemm()
    torch.manual_seed(0)
    weight = torch.randn(256, 128)
    linear = Fp8Linear(128, 256, bias=False)
    linear.fill(0, quantize_rows(weight))
    linear = linear.cuda()
    x = torch.randn(33, 128, device="cuda", dtype=torch.bfloat16)
    x_scale = x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    q_x = (x.float() / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    q_w = linear.weight.float() * linear.weight_scale[:, None]
    got = linear(x)
    assert got.dtype == torch.bfloat16
    # cuBLASLt accumulates in fp32 and rounds to bf16 once.
    torch.testing.assert_close(got.float(), q_x @ q_w.t(), rtol=2**-7, atol=1e-2)


@pytest.mark.gpu
def test_the_engine_on_cuda_runs_fp8_projections_in_its_decode_graphs(
    checkpoints: dict[tuple[str, str, str], tuple[Path, Path]],
) -> None:
    need_fp8_gemm()
    fp8_dir, _ = checkpoints[("compressed-tensors", "channel", "dynamic")]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT[: 3 + i]} for i in range(5)]
    answers = {}
    for graphs in (True, False):
        llm = LLM(fp8_dir, device="cuda", kv_cache_memory=64 << 20, cuda_graphs=graphs)
        model = llm.engine.runner.model
        # An fp8 checkpoint runs its projections in fp8 where the GPU has fp8 GEMMs.
        assert llm.engine.fp8_choice.on
        assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 4 * len(model.model.layers)
        answers[graphs] = [
            list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        del llm
    # Replayed graphs compute what the eager steps do (the tiny model's logits are well spread).
    assert answers[True] == answers[False]


def test_lora_adapters_apply_on_fp8_projections(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The adapter's deltas add to the fp8 projections' output: with the adapter, the fp8
    engine's prompt logprobs follow the float32 engine's with the adapter, not the base's."""
    write_adapter(tmp_path / "adapter", tiny_llama_dir)
    adapter = LoRARequest("a", 1, tmp_path / "adapter")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)

    def prompt_logprobs(llm: LLM, lora: LoRARequest | None) -> torch.Tensor:
        (out,) = llm.generate(
            [{"prompt_token_ids": PROMPT}], params, use_tqdm=False, lora_request=lora
        )
        entries = out.prompt_logprobs[1:]
        return torch.tensor([e[t].logprob for e, t in zip(entries, PROMPT[1:], strict=True)])

    options = {"dtype": "float32", "kv_cache_memory": 8 << 20, "enable_lora": True}
    exact = LLM(tiny_llama_dir, **options)  # type: ignore[arg-type]
    fp8 = LLM(tiny_llama_dir, quantization="fp8", **options)  # type: ignore[arg-type]
    with_adapter = prompt_logprobs(exact, adapter)
    base = prompt_logprobs(exact, None)
    assert (with_adapter - base).abs().mean() > 0.1  # the adapter changes the model
    fp8_error = (prompt_logprobs(fp8, adapter) - with_adapter).abs().mean()
    assert fp8_error < (base - with_adapter).abs().mean() / 4


def test_a_sharded_checkpoint_may_keep_a_weight_and_its_scale_apart(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Each weight in one shard and its scales in the other, the index naming both."""
    fp8_dir, ref_dir = write_fp8_checkpoint(tiny_llama_dir, tmp_path, activations="static")
    tensors = load_file(fp8_dir / "model.safetensors")
    (fp8_dir / "model.safetensors").unlink()
    shards: dict[str, dict[str, torch.Tensor]] = {"scales.safetensors": {}, "rest.safetensors": {}}
    for name, tensor in tensors.items():
        shards["scales.safetensors" if name.endswith("_scale") else "rest.safetensors"][name] = (
            tensor
        )
    weight_map = {name: file for file, part in shards.items() for name in part}
    for file, part in shards.items():
        save_file(part, fp8_dir / file)
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(prefill_logits(load(fp8_dir), PROMPT), prefill_logits(load(ref_dir), PROMPT))
    fused = load(fp8_dir, fp8_linears=True).model.layers[0].self_attn.qkv_proj
    assert isinstance(fused, Fp8Linear) and fused.input_scale == pytest.approx(STATIC_INPUT_SCALE)
