"""GGUF files load into the same model as the safetensors checkpoint they were converted from.

The tiny checkpoints are converted as llama.cpp's converter does (``write_gguf`` in conftest:
renamed tensors, Llama Q/K permuted, tied head dropped). The reference for a quantized file is
the checkpoint with every 2-D weight put through the same quantize → dequantize round trip, so
parity is exact: same parameters, and greedy ids equal to Hugging Face ``generate()``.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine import LLM, SamplingParams
from services.models.config import (
    LinearRopeScaling,
    ModelConfig,
    RopeFrequencyFactors,
    RopeScaling,
)
from services.models.gguf_file import find_gguf, open_gguf
from services.models.gguf_linear import SWITCH_ENV
from services.models.rotary import rope_inv_freq
from support.gguf_files import close_gguf, gguf_source, round_trip_dir

PROMPTS = [[0, 17, 230, 4000, 9, 88, 1024], [0, 5], [3000, 2999, 12, 12, 12, 7, 1, 64, 900, 33, 2]]
NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),  # 0 is also the pad id
                max_new_tokens=NUM_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def engine_params(path: Path) -> dict[str, torch.Tensor]:
    llm = LLM(path, dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
    return {n: p.detach().clone() for n, p in llm.engine.runner.model.named_parameters()}


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [
        ("llama", "F16"),
        ("llama", "Q8_0"),
        ("qwen2", "Q8_0"),
        ("qwen2", "Q5_0"),
        ("llama", "Q5_1"),
        ("qwen3", "F16"),
        ("phi3", "F16"),
        ("phi3", "Q4_0"),
        ("gemma3", "F16"),
        ("gemma3", "Q8_0"),
        ("gemma2", "F16"),
        ("qwen3_moe", "F16"),
        ("qwen3_moe", "Q8_0"),
        ("olmoe", "Q4_0"),
        ("mixtral", "Q8_0"),
    ],
)
def test_gguf_greedy_ids_equal_hugging_face_on_the_same_weights(
    arch: str, qtype: str, tiny_gguf_factory, tmp_path: Path
) -> None:
    gguf_path = tiny_gguf_factory(arch, qtype)
    reference_dir = round_trip_dir(gguf_source(gguf_path), qtype, tmp_path / "ref")
    expected = hf_greedy(reference_dir, PROMPTS)

    llm = LLM(
        gguf_path,
        dtype="float32",
        kv_cache_dtype="float32",  # transformers keeps fp32 K/V: compare like with like
        max_model_len=64,
        kv_cache_memory=1 << 20,
    )
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q4_0", "Q4_1"])
def test_gguf_parameters_equal_the_round_tripped_checkpoint(
    qtype: str, tiny_gguf_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every weight dequantized, as on a GPU; test_gguf_codes.py checks the projections that
    # stay codes on a CPU against the same reference.
    monkeypatch.setenv(SWITCH_ENV, "0")
    gguf_path = tiny_gguf_factory("llama", qtype)
    reference = engine_params(round_trip_dir(gguf_source(gguf_path), qtype, tmp_path / "r"))
    loaded = engine_params(gguf_path)
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name


def test_gguf_config_matches_config_json(tiny_gguf_factory) -> None:
    archs = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "gemma2", "qwen3_moe", "olmoe", "mixtral")
    for arch in archs:
        gguf_path = tiny_gguf_factory(arch, "F16")
        from_json = ModelConfig.from_model_dir(gguf_source(gguf_path))
        from_gguf = ModelConfig.from_model_path(gguf_path)
        # GGUF stores the epsilon as float32.
        assert from_gguf.rms_norm_eps == pytest.approx(from_json.rms_norm_eps, rel=1e-6)
        if arch == "llama":
            # The tiny Llama has Llama 3.1's rope scaling, which the file carries as llama.cpp's
            # rope_freqs divisors: the same frequencies to float32's rounding.
            assert isinstance(from_gguf.rope_scaling, RopeFrequencyFactors)
            assert isinstance(from_json.rope_scaling, RopeScaling)
            head_dim, theta = from_json.head_dim, from_json.rope_theta
            torch.testing.assert_close(
                rope_inv_freq(head_dim, theta, from_gguf.rope_scaling),
                rope_inv_freq(head_dim, theta, from_json.rope_scaling),
                rtol=1e-6,
                atol=0,
            )
            from_gguf = replace(from_gguf, rope_scaling=from_json.rope_scaling)
        assert replace(from_gguf, rms_norm_eps=from_json.rms_norm_eps) == from_json, arch


def test_a_directory_holding_one_gguf_is_a_model(tiny_gguf_factory, tmp_path: Path) -> None:
    gguf_path = tiny_gguf_factory("llama", "F16")
    model_dir = tmp_path / "one"
    model_dir.mkdir()
    shutil.copy(gguf_path, model_dir)
    assert find_gguf(model_dir) == model_dir / gguf_path.name
    assert (
        LLM(model_dir, dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
        .generate(PROMPTS[:1], GREEDY)[0]
        .token_ids
        == LLM(gguf_path, dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
        .generate(PROMPTS[:1], GREEDY)[0]
        .token_ids
    )

    shutil.copy(gguf_path, model_dir / "second.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        ModelConfig.from_model_path(model_dir)


def test_an_unsupported_quant_type_is_named(tiny_gguf_factory) -> None:
    with pytest.raises(ValueError, match=r"quantized as MXFP4, which pdserve does not load"):
        LLM(tiny_gguf_factory("llama", "MXFP4"), dtype="float32", max_model_len=64)


def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    close_gguf(writer)
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'mamba'.*llama"):
        ModelConfig.from_model_path(path)


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        ModelConfig.from_model_path(tmp_path / "missing.gguf")


def test_a_file_that_is_not_gguf_is_named(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match=r"notes\.gguf: not a readable GGUF file"):
        ModelConfig.from_model_path(path)


def test_a_truncated_gguf_is_named(tiny_gguf_factory, tmp_path: Path) -> None:
    data = tiny_gguf_factory("llama", "Q8_0").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ValueError, match=r"cut\.gguf: tensor .* runs past the end of the file"):
        LLM(path, dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)


def rope_gguf(path: Path, arch: str = "llama", **rope: object) -> Path:
    """A one-layer GGUF header with the given rope metadata and ``rope_freqs`` values."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)  # head_dim 4: two frequencies
    if "dimensions" in rope:
        writer.add_rope_dimension_count(rope["dimensions"])
    if "longrope" in rope:
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            writer.add_tensor(name, np.ones(2, dtype=np.float32))
    if "scaling" in rope:
        writer.add_rope_scaling_type(rope["scaling"])
        writer.add_rope_scaling_factor(2.0)
    if "freqs" in rope:
        writer.add_tensor("rope_freqs.weight", np.array(rope["freqs"], dtype=np.float32))
    close_gguf(writer)
    return path


def test_llama_3_1_rope_frequency_factors_divide_the_frequencies(tmp_path: Path) -> None:
    config = ModelConfig.from_model_path(rope_gguf(tmp_path / "l31.gguf", freqs=[1.0, 8.0]))
    assert config.rope_scaling == RopeFrequencyFactors((1.0, 8.0))
    plain = rope_inv_freq(4, config.rope_theta, None)
    assert torch.equal(
        rope_inv_freq(4, config.rope_theta, config.rope_scaling), plain / torch.tensor([1.0, 8.0])
    )


def test_a_linear_rope_scaling_is_taken(tmp_path: Path) -> None:
    path = rope_gguf(tmp_path / "linear.gguf", scaling=gguf.RopeScalingType.LINEAR)
    assert ModelConfig.from_model_path(path).rope_scaling == LinearRopeScaling(2.0)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"freqs": [1.0, 1.0, 1.0]}, r"rope_freqs must hold 2 positive finite factors"),
        ({"freqs": [1.0, 0.0]}, r"rope_freqs must hold 2 positive finite factors"),
        ({"freqs": [1.0, float("nan")]}, r"rope_freqs must hold 2 positive finite factors"),
        ({"scaling": gguf.RopeScalingType.YARN}, r"unsupported rope scaling 'yarn'"),
        ({"arch": "phi3", "longrope": True}, r"unsupported rope scaling 'longrope'"),
        ({"arch": "phi3", "dimensions": 2}, r"partial_rotary_factor 0.5"),
    ],
)
def test_rope_settings_pdserve_cannot_run_are_refused(
    tmp_path: Path, rope: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_model_path(rope_gguf(tmp_path / "bad.gguf", **rope))


def gemma3_header(
    path: Path, num_layers: int, pattern: object = None, arch: str = "gemma3"
) -> dict:
    """The config.json of a Gemma 3 (or 2) GGUF header (no tensors) of ``num_layers`` layers."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(num_layers)
    writer.add_embedding_length(5376)
    writer.add_head_count(32)
    writer.add_key_length(128)
    writer.add_sliding_window(1024)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    close_gguf(writer)
    return open_gguf(path).hf_config()


def test_gemma3_files_get_what_llama_cpp_fixes_in_code(tmp_path: Path) -> None:
    config = gemma3_header(tmp_path / "g.gguf", 12)
    assert config["model_type"] == "gemma3_text"
    # No pattern in the file: every sixth layer global.
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11]
    assert config["rope_local_base_freq"] == 10000.0
    assert config["query_pre_attn_scalar"] == 128  # head_dim
    assert config["sliding_window"] == 1024
    every_third = gemma3_header(tmp_path / "g3.gguf", 6, pattern=3)["layer_types"]
    assert every_third == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    flags = gemma3_header(tmp_path / "gf.gguf", 3, pattern=[True, False, True])["layer_types"]
    assert flags == ["sliding_attention", "full_attention", "sliding_attention"]
    # The 27B (62 layers) scales by hidden_size / num_heads (168), not head_dim (128).
    assert gemma3_header(tmp_path / "g27.gguf", 62)["query_pre_attn_scalar"] == 168
    with pytest.raises(ValueError, match="sliding_window_pattern holds 2 flags for 3 layers"):
        gemma3_header(tmp_path / "bad.gguf", 3, pattern=[True, False])


def test_gemma2_files_get_what_llama_cpp_fixes_in_code(tmp_path: Path) -> None:
    config = gemma3_header(tmp_path / "g2.gguf", 4, arch="gemma2")
    assert config["model_type"] == "gemma2"
    # Every other layer global, the first sliding; one RoPE base (no local one).
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert "rope_local_base_freq" not in config and config["query_pre_attn_scalar"] == 128
    # The 27B (46 layers) scales by hidden_size / num_heads.
    assert gemma3_header(tmp_path / "g27.gguf", 46, arch="gemma2")["query_pre_attn_scalar"] == 168
