"""What a caller can get wrong in the engine's settings or model is an ``EngineConfigError`` (a
``ValueError``) naming the setting, raised before any work it would waste: never a torch
traceback, and never a setting accepted that makes start-up crash or crawl."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gateway.config import model_max_len
from services.engine import LLM, CacheConfig, EngineConfig, SchedulerConfig
from services.engine.gpu_memory import MemorySnapshot
from services.engine.model_runner import ModelRunner
from services.models import ModelFileError
from services.models.config import LinearRopeScaling, ModelConfig
from services.types import EngineConfigError

MAX_BLOCK_SIZE = 128  # vLLM's largest block size
MAX_STATIC_DECODE_BATCH = 512  # vLLM's largest CUDA graph batch size
MAX_MODEL_LEN = 64
KV_CACHE_MEMORY = 1 << 20


class FakeReader:
    """A device of ``total`` bytes, half of it free."""

    def __init__(self, total: int) -> None:
        self.total = total

    def reset_peak(self) -> None:
        pass

    def snapshot(self) -> MemorySnapshot:
        half = self.total // 2
        return MemorySnapshot(self.total, half, half, half)


def make_runner(model_dir: Path) -> ModelRunner:
    config = EngineConfig(model_dir=model_dir, dtype="float32")
    return ModelRunner(ModelConfig.from_model_dir(model_dir), config, max_model_len=128)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: CacheConfig(kv_cache_memory=-1), "kv_cache_memory"),
        (lambda: CacheConfig(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: SchedulerConfig(policy="lifo"), "policy"),  # type: ignore[arg-type]
        (lambda: EngineConfig(Path("m"), dtype="int8"), "dtype"),
        (lambda: EngineConfig(Path("m"), device="tpu"), "device"),
    ],
)
def test_bad_settings_are_engine_config_errors_naming_the_field(make, field: str) -> None:
    with pytest.raises(EngineConfigError, match=field):
        make()


def test_an_engine_config_error_is_a_value_error_for_the_offline_api() -> None:
    assert issubclass(EngineConfigError, ValueError)


@pytest.mark.parametrize("block_size", [MAX_BLOCK_SIZE + 1, 4096])
def test_a_block_size_beyond_the_largest_is_refused_by_every_entry_point(
    tiny_llama_dir: Path, block_size: int
) -> None:
    message = rf"block_size must be in \[1, {MAX_BLOCK_SIZE}\], got {block_size}"
    with pytest.raises(EngineConfigError, match=message):
        CacheConfig(block_size=block_size)
    # Refused before the model loads or any prefill kernel is timed on a block-sized buffer.
    with pytest.raises(EngineConfigError, match=message):
        LLM(tiny_llama_dir, dtype="float32", block_size=block_size)


def test_a_model_of_an_unsupported_kind_is_an_engine_config_error(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GemmaForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineConfigError, match="unsupported architecture GemmaForCausalLM"):
        LLM(model_dir, dtype="float32", kv_cache_memory=KV_CACHE_MEMORY)


def test_a_checkpoint_missing_a_weight_is_a_model_file_error_naming_it(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ModelFileError, match=r"missing weight\(s\): model\.norm\.weight"):
        LLM(model_dir, dtype="float32", kv_cache_memory=KV_CACHE_MEMORY)


@pytest.mark.parametrize(("key", "value"), [("hidden_size", None), ("num_hidden_layers", "12")])
def test_a_config_without_a_size_it_needs_is_a_model_file_error_naming_the_key(
    tiny_llama_dir: Path, tmp_path: Path, key: str, value: object
) -> None:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    config = json.loads((model_dir / "config.json").read_text())
    if value is None:
        del config[key]
    else:
        config[key] = value
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=rf"config\.json: has .*'{key}'"):
        LLM(model_dir, dtype="float32", kv_cache_memory=KV_CACHE_MEMORY)


def test_the_largest_block_size_is_accepted() -> None:
    assert CacheConfig(block_size=MAX_BLOCK_SIZE).block_size == MAX_BLOCK_SIZE


def test_an_unknown_scheduling_policy_is_refused_naming_the_argument(tiny_llama_dir: Path) -> None:
    with pytest.raises(EngineConfigError, match="scheduling_policy must be one of fcfs, priority"):
        LLM(tiny_llama_dir, dtype="float32", scheduling_policy="lifo")


def test_a_kv_cache_the_process_cannot_allocate_is_refused_naming_the_setting(
    tiny_llama_dir: Path,
) -> None:
    # 2**60 bytes: 2**58 a layer, beyond any address space, so the allocator fails on any host
    # (before a page is touched).
    with pytest.raises(EngineConfigError) as refusal:
        LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=2**60)
    message = str(refusal.value)
    assert message.startswith("kv_cache_memory: cannot allocate a KV cache of ")
    assert "bytes" in message and "lower kv_cache_memory" in message
    assert "\n" not in message
    assert "gpu_memory_utilization" not in message  # CPU: that setting plays no part


def test_a_failed_kv_cache_allocation_frees_what_it_got_and_a_smaller_cache_works(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(tiny_llama_dir)
    real_empty = torch.empty
    calls = []

    def empty_failing_on_the_third_layer(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes."
            )
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty_failing_on_the_third_layer)
    with pytest.raises(EngineConfigError, match="can't allocate memory"):
        runner.allocate_kv_cache(8)
    assert runner.kv_caches == []
    monkeypatch.setattr(torch, "empty", real_empty)
    runner.allocate_kv_cache(8)
    assert len(runner.kv_caches) == runner.model_config.num_layers


def test_an_unrelated_runtime_error_from_the_allocation_keeps_its_type(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(tiny_llama_dir)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "empty", broken)
    with pytest.raises(RuntimeError, match="illegal memory access") as raised:
        runner.allocate_kv_cache(8)
    assert not isinstance(raised.value, EngineConfigError)


def test_on_a_gpu_the_allocation_refusal_names_both_memory_settings() -> None:
    from services.engine.model_runner import kv_cache_allocation_error

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.\nmore details")
    error = kv_cache_allocation_error(
        oom, num_bytes=21474836480, num_blocks=10240, device=torch.device("cuda:0")
    )
    assert isinstance(error, EngineConfigError)
    message = str(error)
    assert "21474836480 bytes" in message and "cuda:0" in message
    assert "lower kv_cache_memory or gpu_memory_utilization" in message
    assert "more details" not in message  # one line


def test_a_profiling_step_that_runs_out_of_memory_names_the_step_budget(
    tiny_llama_dir: Path,
) -> None:
    runner = make_runner(tiny_llama_dir)

    def out_of_memory() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB.")

    runner.profile_run = out_of_memory  # type: ignore[method-assign]
    reader = FakeReader(total=64 << 20)
    with pytest.raises(EngineConfigError, match="lower max_num_batched_tokens"):
        runner.num_blocks_for(CacheConfig(gpu_memory_utilization=0.5), reader)


def test_a_huge_max_num_seqs_does_not_size_the_static_decode_buffers(tiny_llama_dir: Path) -> None:
    # Static decode (CUDA graphs on a GPU) used one bucket per 16 of max_num_seqs, each with its
    # buffers and graph: 10**7 took 25 s and 1.3 GB on CPU, and a GPU would capture 625,000
    # graphs. Batches above the largest bucket run the dynamic path.
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=KV_CACHE_MEMORY,
        max_num_seqs=10**5,
        cuda_graphs=True,
    )
    static = llm.engine.runner.static_decode
    assert static is not None
    assert static.max_batch == MAX_STATIC_DECODE_BATCH
    assert len(static.buckets) <= MAX_STATIC_DECODE_BATCH // 16 + 4


def smollm3_config(**changes: object) -> dict:
    config = {
        "architectures": ["SmolLM3ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 8,
        "vocab_size": 100,
    }
    return {**config, **changes}


def test_smollm3_layers_without_rope_come_from_its_list_or_its_interval() -> None:
    listed = ModelConfig.from_hf_dict(smollm3_config(no_rope_layers=[1, 0, 1, 1, 0, 1, 1, 1]))
    assert listed.nope_layers == {1, 4}
    # transformers' default without a list: every no_rope_layer_interval-th layer (4).
    assert ModelConfig.from_hf_dict(smollm3_config()).nope_layers == {3, 7}
    assert ModelConfig.from_hf_dict(smollm3_config(no_rope_layer_interval=2)).nope_layers == {
        1,
        3,
        5,
        7,
    }
    # Tied embeddings unless it says otherwise; the sliding window only where it opts in.
    config = ModelConfig.from_hf_dict(smollm3_config(sliding_window=32))
    assert config.tie_word_embeddings and config.sliding_window is None
    # Every other architecture ropes every layer.
    llama = ModelConfig.from_hf_dict({**smollm3_config(), "architectures": ["LlamaForCausalLM"]})
    assert llama.nope_layers == frozenset()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"no_rope_layers": [1, 0, 1]}, "no_rope_layers must be a list of 8 values"),
        ({"no_rope_layers": [1, 2, 1, 1, 1, 1, 1, 1]}, "each 0 or 1"),
        ({"no_rope_layers": "1,0"}, "no_rope_layers"),
        ({"no_rope_layer_interval": 0}, "no_rope_layer_interval must be a positive integer"),
    ],
)
def test_a_bad_smollm3_rope_layer_list_is_refused_naming_the_key(changes, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        ModelConfig.from_hf_dict(smollm3_config(**changes))


def test_granite_multipliers_are_read_and_checked() -> None:
    granite = {**smollm3_config(), "architectures": ["GraniteForCausalLM"]}
    config = ModelConfig.from_hf_dict(
        {
            **granite,
            "attention_multiplier": 0.015625,
            "logits_scaling": 8,
            "residual_multiplier": 0.2,
        }
    )
    assert config.attention_scale == 0.015625
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (
        1.0,
        0.2,
        8.0,
    )
    # transformers' defaults are all 1, the attention scale too (not 1 / sqrt(head_dim)).
    assert ModelConfig.from_hf_dict(granite).attention_scale == 1.0
    assert ModelConfig.from_hf_dict(smollm3_config()).attention_scale == 16**-0.5
    for bad in (0, -1.5, "2", True, float("inf")):
        with pytest.raises(EngineConfigError, match="logits_scaling must be a positive number"):
            ModelConfig.from_hf_dict({**granite, "logits_scaling": bad})


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
            r"partial_rotary_factor 0\.75 \(rotary over part of each head\) is not supported",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "rope_type 'longrope'"),
    ],
)
def test_phi_rotary_variants_not_built_are_refused_by_name(rope: dict, message: str) -> None:
    phi3 = {**smollm3_config(), "architectures": ["Phi3ForCausalLM"], **rope}
    with pytest.raises(EngineConfigError, match=message):
        ModelConfig.from_hf_dict(phi3)
    # A plain Phi-3 (or Phi-4) reads, its checkpoint's projections fused.
    plain = ModelConfig.from_hf_dict({**smollm3_config(), "architectures": ["Phi3ForCausalLM"]})
    assert plain.fused_checkpoint and not plain.tie_word_embeddings


def moe_config(arch: str, **changes: object) -> dict:
    experts = {"num_local_experts": 4} if arch == "MixtralForCausalLM" else {"num_experts": 8}
    extra = {} if arch == "MixtralForCausalLM" else {"moe_intermediate_size": 32}
    base = {**smollm3_config(), "architectures": [arch], "num_experts_per_tok": 2}
    return {**base, **experts, **extra, **changes}


def test_mixture_of_experts_layers_are_read_as_transformers_reads_them() -> None:
    mixtral = ModelConfig.from_hf_dict(moe_config("MixtralForCausalLM"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (4, 2)
    assert mixtral.moe_intermediate_size == 128 and mixtral.norm_topk_prob
    assert mixtral.moe_layers == set(range(8)) and mixtral.routing_weights_in_fp32
    qwen = ModelConfig.from_hf_dict(
        moe_config("Qwen3MoeForCausalLM", decoder_sparse_step=2, mlp_only_layers=[3])
    )
    # Every second layer (from the second) but the fourth; no renormalization by default.
    assert qwen.moe_layers == {1, 5, 7} and not qwen.norm_topk_prob
    assert qwen.moe_intermediate_size == 32 and qwen.qk_norm
    # transformers 5 writes Qwen3-MoE's expert count under Mixtral's key.
    renamed = moe_config("Qwen3MoeForCausalLM")
    renamed["num_local_experts"] = renamed.pop("num_experts")
    assert ModelConfig.from_hf_dict(renamed).num_experts == 8
    assert not ModelConfig.from_hf_dict(smollm3_config()).is_moe
    # Granite's MoE: Granite's multipliers, experts of intermediate_size in every layer, the
    # softmax over the top k logits.
    granite = ModelConfig.from_hf_dict(
        moe_config("MixtralForCausalLM", residual_multiplier=0.22)
        | {"architectures": ["GraniteMoeForCausalLM"]}
    )
    assert granite.softmax_over_top_k and granite.residual_multiplier == 0.22
    assert granite.moe_layers == set(range(8)) and granite.moe_intermediate_size == 128
    # OLMoE: experts of intermediate_size in every layer, not renormalized unless it says so,
    # Q/K norms across the heads (as OLMo 2) but the pre-norm layers of Llama.
    olmoe = ModelConfig.from_hf_dict(
        moe_config("Qwen3MoeForCausalLM") | {"architectures": ["OlmoeForCausalLM"]}
    )
    assert olmoe.moe_layers == set(range(8)) and olmoe.moe_intermediate_size == 128
    assert not olmoe.norm_topk_prob and olmoe.qk_norm and olmoe.qk_norm_whole_width
    assert not olmoe.post_norms


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("MixtralForCausalLM", {"num_local_experts": 0}, "num_local_experts must be a positive"),
        ("MixtralForCausalLM", {"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) exceeds"),
        ("Qwen3MoeForCausalLM", {"moe_intermediate_size": None}, "moe_intermediate_size"),
        ("Qwen3MoeForCausalLM", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("Qwen3MoeForCausalLM", {"mlp_only_layers": 3}, "mlp_only_layers must be a list"),
        ("OlmoeForCausalLM", {"clip_qkv": 8.0}, "clip_qkv"),
        ("OlmoeForCausalLM", {"num_experts": 0}, "num_experts must be a positive"),
    ],
)
def test_a_bad_mixture_of_experts_config_is_refused_naming_the_key(arch, changes, message) -> None:
    with pytest.raises(EngineConfigError, match=message):
        ModelConfig.from_hf_dict(moe_config(arch, **changes))


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"enable_lora": True}, "enable_lora: LoRA on a mixture of experts"),
        ({"quantization": "fp8"}, "quantization: fp8 projections of a mixture of experts"),
        ({"cuda_graphs": True}, "cuda_graphs: a mixture of experts"),
    ],
)
def test_what_a_mixture_of_experts_does_not_run_with_is_refused_naming_it(
    tiny_model_factory, setting: dict, message: str
) -> None:
    with pytest.raises(EngineConfigError, match=message):
        LLM(
            tiny_model_factory("mixtral"),
            dtype="float32",
            kv_cache_memory=KV_CACHE_MEMORY,
            **setting,
        )


def gemma3_config(**changes: object) -> dict:
    base = {**smollm3_config(), "architectures": ["Gemma3ForCausalLM"], "sliding_window": 16}
    return {**base, **changes}


def test_gemma3_layers_windows_and_rope_bases_are_read_as_transformers_reads_them() -> None:
    old_style = ModelConfig.from_hf_dict(
        gemma3_config(rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=64)
    )
    # Without layer_types, every sixth layer is global (transformers' sliding_window_pattern).
    assert old_style.sliding_layers == {0, 1, 2, 3, 4, 6, 7}
    assert (old_style.rope_theta, old_style.local_rope_theta) == (1e6, 1e4)
    assert old_style.local_window == 16 and old_style.sliding_window is None  # not a global cap
    assert old_style.attention_scale == 64**-0.5 and old_style.embedding_multiplier == 64**0.5
    assert old_style.tie_word_embeddings and old_style.norm_weight_offset == 1.0
    types = ["full_attention" if i % 2 else "sliding_attention" for i in range(8)]
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e3},
        "full_attention": {"rope_type": "default", "rope_theta": 2e6},
    }
    new_style = ModelConfig.from_hf_dict(gemma3_config(layer_types=types, rope_parameters=rope))
    assert new_style.sliding_layers == {0, 2, 4, 6}
    assert (new_style.rope_theta, new_style.local_rope_theta) == (2e6, 5e3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types must list 8"),
        ({"sliding_window": None}, "sliding_window must be a positive integer"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
)
def test_what_gemma3_does_not_run_with_is_refused_naming_the_key(changes, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        ModelConfig.from_hf_dict(gemma3_config(**changes))


def test_gemma2_caps_and_layers_are_read_as_transformers_reads_them() -> None:
    config = ModelConfig.from_hf_dict(
        gemma3_config(
            architectures=["Gemma2ForCausalLM"],
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30,
            query_pre_attn_scalar=64,
        )
    )
    # Without layer_types, the even layers slide (transformers' Gemma2Config).
    assert config.sliding_layers == {0, 2, 4, 6} and config.local_window == 16
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.local_rope_theta is None and not config.qk_norm  # one RoPE base, no Q/K norm
    assert config.attention_scale == 64**-0.5 and config.norm_weight_offset == 1.0
    uncapped = ModelConfig.from_hf_dict(gemma3_config(architectures=["Gemma2ForCausalLM"]))
    assert uncapped.attn_logit_softcapping is None and uncapped.final_logit_softcapping is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attn_logit_softcapping": 0}, "attn_logit_softcapping must be a positive number"),
        ({"final_logit_softcapping": "30"}, "final_logit_softcapping must be a positive number"),
        ({"final_logit_softcapping": float("inf")}, "final_logit_softcapping must be a positive"),
        ({"layer_types": ["full_attention"]}, "layer_types must list 8"),
    ],
)
def test_a_bad_gemma2_config_is_refused_naming_the_key(changes, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        ModelConfig.from_hf_dict(gemma3_config(architectures=["Gemma2ForCausalLM"], **changes))


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"attention_backend": "triton"}, "attention_backend: .*sliding-window layers"),
        ({"enable_lora": True}, "enable_lora: LoRA on Gemma[23]ForCausalLM's GELU-gated MLP"),
    ],
)
def test_what_a_gemma_engine_does_not_run_with_is_refused_naming_it(
    tiny_model_factory, arch: str, setting: dict, message: str
) -> None:
    # Triton runs under its interpreter in the suite (tests/conftest.py), so the refusal is the
    # sliding window's, not the device's.
    with pytest.raises(EngineConfigError, match=message):
        LLM(
            tiny_model_factory(arch),
            dtype="float32",
            kv_cache_memory=KV_CACHE_MEMORY,
            **setting,
        )


def test_a_multimodal_gemma3_is_served_as_its_language_model(tmp_path: Path) -> None:
    """google/gemma-3-4b-it's config.json names only some of its text model's keys; the rest
    are transformers' defaults, as for transformers itself."""
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"hidden_size": 1152},
        "eos_token_id": [1, 106],
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_model_dir(tmp_path)
    assert config.architecture == "Gemma3ForCausalLM" and config.weight_prefix == "language_model."
    assert (config.vocab_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        262208,
        8,
        4,
        256,
    )
    assert config.rope_scaling == LinearRopeScaling(8.0) and config.rope_theta == 1e6
    assert config.local_rope_theta == 1e4 and config.local_window == 1024
    assert config.sliding_layers == set(range(34)) - {5, 11, 17, 23, 29}
    assert config.tie_word_embeddings and config.eos_token_ids == (1, 106)
    # The gateway's context length comes from the same text model.
    assert model_max_len(tmp_path) == 131072
    # A multimodal config without its text model's is refused, naming it.
    (tmp_path / "config.json").write_text(json.dumps({**raw, "text_config": None}))
    with pytest.raises(EngineConfigError, match="has no text_config"):
        ModelConfig.from_model_dir(tmp_path)


@pytest.mark.parametrize("factor", [0, -2.0, "8", None])
def test_a_linear_rope_scaling_without_a_positive_factor_is_refused(factor) -> None:
    rope = {"rope_scaling": {"rope_type": "linear", "factor": factor}}
    with pytest.raises(EngineConfigError, match="factor must be a positive number"):
        ModelConfig.from_hf_dict(
            {**smollm3_config(), "architectures": ["LlamaForCausalLM"], **rope}
        )


def test_a_soft_capped_model_without_sliding_layers_is_refused_on_triton(
    tiny_model_factory, tmp_path
) -> None:
    """Its Triton kernels do not cap: with every layer global (no sliding-window refusal), the
    cap alone refuses the backend."""
    model_dir = Path(shutil.copytree(tiny_model_factory("gemma2"), tmp_path / "gemma2"))
    config = json.loads((model_dir / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineConfigError, match="attention_backend: .*soft-capped attention"):
        LLM(model_dir, dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, attention_backend="triton")
