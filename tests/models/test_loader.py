"""The safetensors loader: parity with Hugging Face on the same weights, and clear load errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.engine import LLM, SamplingParams
from services.models import ModelFileError
from services.models.attention import TorchPagedAttention
from services.models.config import ModelConfig, with_overrides
from services.models.llama import LlamaForCausalLM, SparseMoe
from services.models.loader import load_model
from services.models.tiny import ARCHS
from support.prefill_logits import prefill_logits as support_prefill_logits

BLOCK_SIZE = 4
MAX_POSITIONS = 64
# A few prompts of different lengths (one shorter than a block, one not block-aligned).
PROMPTS = [[0, 17, 230, 4000, 9, 88, 1024], [0, 5], [3000, 2999, 12, 12, 12, 7, 1, 64, 900, 33, 2]]
KV_CACHE_MEMORY = 2 << 20


def load_ours(model_dir: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    config = ModelConfig.from_model_dir(model_dir)
    backend = TorchPagedAttention(BLOCK_SIZE, scale=config.attention_scale)
    return load_model(
        model_dir,
        config,
        dtype=dtype,
        device=torch.device("cpu"),
        max_positions=MAX_POSITIONS,
        backend=backend,
    )


def load_hf(model_dir: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def prefill_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    return support_prefill_logits(model, token_ids, BLOCK_SIZE)


@torch.inference_mode()
def hf_greedy(model: PreTrainedModel, token_ids: list[int], num_tokens: int) -> list[int]:
    ids = list(token_ids)
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(token_ids) :]


def copy_model(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "model"))


def edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def rewrite_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# --- parity with Hugging Face ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tiny_model_factory) -> Callable[[str], PreTrainedModel]:
    """``hf_model(arch)``: the Hugging Face model of the tiny ``arch``, loaded once per module."""
    loaded: dict[str, PreTrainedModel] = {}

    def get(arch: str) -> PreTrainedModel:
        if arch not in loaded:
            loaded[arch] = load_hf(tiny_model_factory(arch))
        return loaded[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_hugging_face(tiny_model_factory, hf_model, arch: str) -> None:
    ours, hf = load_ours(tiny_model_factory(arch)), hf_model(arch)

    for prompt in PROMPTS:
        logits = prefill_logits(ours, prompt)
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_hugging_face(tiny_model_factory, hf_model, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    hf = hf_model(arch)
    # Small blocks and a small step budget: decodes cross blocks and a prompt is chunked.
    llm = LLM(
        model_dir,
        dtype="float32",
        kv_cache_dtype="float32",  # transformers keeps fp32 K/V: compare like with like
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=8,
        max_model_len=MAX_POSITIONS,
        kv_cache_memory=KV_CACHE_MEMORY,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)

    outputs = llm.generate(PROMPTS, params)

    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.token_ids == hf_greedy(hf, prompt, 8)
        with torch.inference_mode():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1)
        first = output.logprobs[0]
        assert output.token_ids[0] in first
        top = expected.topk(3).indices.tolist()
        assert set(top) <= set(first)
        for token_id, logprob in first.items():
            assert logprob.logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
    assert llm.engine.stats().num_blocks_used == 0


def test_sharded_checkpoint_loads_the_same_weights(tiny_model_factory) -> None:
    single_dir = tiny_model_factory("llama")
    sharded_dir = tiny_model_factory("llama", sharded=True)
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(list(sharded_dir.glob("model-*.safetensors"))) > 1

    single, sharded = load_ours(single_dir), load_ours(sharded_dir)

    expected = single.state_dict()
    for name, tensor in sharded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    prompt = PROMPTS[0]
    assert torch.equal(prefill_logits(sharded, prompt), prefill_logits(single, prompt))


def test_tied_embeddings_share_one_matrix(tiny_model_factory) -> None:
    model = load_ours(tiny_model_factory("qwen2"))
    assert model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_bfloat16_loads_and_generates(tiny_model_factory) -> None:
    llm = LLM(
        tiny_model_factory("llama"),
        dtype="bfloat16",
        max_model_len=MAX_POSITIONS,
        kv_cache_memory=KV_CACHE_MEMORY,
    )
    assert llm.engine.runner.model.model.embed_tokens.weight.dtype is torch.bfloat16

    [output] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, ignore_eos=True))

    assert len(output.token_ids) == 5
    assert all(0 <= t < 4096 for t in output.token_ids)


def test_float16_on_cpu_is_refused(tiny_model_factory) -> None:
    with pytest.raises(ValueError, match="float16"):
        LLM(tiny_model_factory("llama"), dtype="float16", kv_cache_memory=KV_CACHE_MEMORY)


# --- load errors -----------------------------------------------------------------------------


def test_missing_weight_is_named(tiny_model_factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory("llama"), tmp_path)
    rewrite_weights(model_dir, lambda t: t.pop("model.layers.2.mlp.down_proj.weight"))

    with pytest.raises(
        ValueError, match=r"missing weight.*model\.layers\.2\.mlp\.down_proj\.weight"
    ):
        load_ours(model_dir)


def test_unexpected_weight_is_named(tiny_model_factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory("llama"), tmp_path)
    rewrite_weights(
        model_dir, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.ones(2)})
    )

    with pytest.raises(ValueError, match=r"unexpected weight.*model\.layers\.0\.self_attn\.extra"):
        load_ours(model_dir)


@pytest.mark.parametrize(
    ("name", "cut"),
    [
        ("model.layers.1.self_attn.o_proj.weight", lambda t: t[:, :64]),  # too few columns
        ("model.layers.1.self_attn.o_proj.weight", lambda t: t[:64]),  # too few rows
        ("model.layers.1.self_attn.o_proj.weight", lambda t: torch.cat([t, t])),  # too many
        ("model.layers.0.self_attn.k_proj.weight", lambda t: t[:32]),  # a fused part's rows
        ("model.layers.0.mlp.up_proj.weight", lambda t: t[:-1]),  # the last part's
        ("model.norm.weight", lambda t: t[:-1]),
    ],
)
def test_weight_of_the_wrong_shape_is_named(
    name: str, cut: Callable[[torch.Tensor], torch.Tensor], tiny_model_factory, tmp_path: Path
) -> None:
    """Every weight fills exactly its rows: one of too few would leave rows as they were
    allocated (it did, before each part's row count was checked)."""
    model_dir = copy_model(tiny_model_factory("llama"), tmp_path)
    rewrite_weights(model_dir, lambda t: t.update({name: cut(t[name]).contiguous()}))

    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}.*shape"):
        load_ours(model_dir)


def test_rotary_buffers_in_the_checkpoint_are_ignored(tiny_model_factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory("llama"), tmp_path)
    rewrite_weights(
        model_dir,
        lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}),
    )

    model = load_ours(model_dir)

    expected = load_ours(tiny_model_factory("llama"))
    assert torch.equal(prefill_logits(model, PROMPTS[0]), prefill_logits(expected, PROMPTS[0]))


def test_unsupported_architecture_is_named(tiny_model_factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory("llama"), tmp_path)
    edit_config(model_dir, architectures=["GPT2LMHeadModel"])

    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model_dir, dtype="float32", kv_cache_memory=KV_CACHE_MEMORY)


def test_unsupported_rope_type_is_refused(tiny_model_factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory("qwen3"), tmp_path)
    edit_config(model_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0})

    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        LLM(model_dir, dtype="float32", kv_cache_memory=KV_CACHE_MEMORY)


def test_dir_without_config_is_a_clear_error(tiny_model_factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory("llama"), tmp_path)
    (model_dir / "config.json").unlink()

    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(model_dir, dtype="float32", kv_cache_memory=KV_CACHE_MEMORY)


def test_dir_without_weights_is_a_clear_error(tiny_model_factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory("llama"), tmp_path)
    (model_dir / "model.safetensors").unlink()

    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        LLM(model_dir, dtype="float32", kv_cache_memory=KV_CACHE_MEMORY)


def test_missing_shard_is_a_clear_error(tiny_model_factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory("llama", sharded=True), tmp_path)
    (model_dir / "model-00002-of-00004.safetensors").unlink()

    with pytest.raises(FileNotFoundError, match="model-00002-of-00004.safetensors"):
        load_ours(model_dir)


def test_config_json_that_is_not_json_is_named(tiny_model_factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory("llama"), tmp_path)
    (model_dir / "config.json").write_text("{")

    with pytest.raises(ModelFileError, match=r"config\.json: not valid JSON: Expecting"):
        ModelConfig.from_model_path(model_dir)


@pytest.mark.parametrize(
    ("cut", "problem"),
    [
        (lambda data: b"\xff" * 100, "header too large"),
        (lambda data: data[: len(data) // 2], "incomplete"),
    ],
    ids=["garbage", "truncated"],
)
def test_a_corrupt_safetensors_file_is_named(
    tiny_model_factory, tmp_path: Path, cut: Callable[[bytes], bytes], problem: str
) -> None:
    model_dir = copy_model(tiny_model_factory("llama"), tmp_path)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(cut(weights.read_bytes()))

    with pytest.raises(ModelFileError, match=rf"model\.safetensors: not a valid .*{problem}"):
        load_ours(model_dir)


def test_an_empty_model_dir_says_it_is_empty(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"is an empty directory: expected a Hugging"):
        ModelConfig.from_model_path(tmp_path)


def test_a_dir_of_other_files_says_what_it_lacks(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json and no GGUF file: expected"):
        ModelConfig.from_model_path(tmp_path)


def test_hf_overrides_replace_config_values_and_merge_nested_ones(tiny_llama_dir: Path) -> None:
    raw = {"a": 1, "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "keep": [1]}
    merged = with_overrides(raw, {"a": 2, "rope_scaling": {"factor": 4.0}, "new": None})
    assert merged == {"a": 2, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                      "keep": [1], "new": None}  # fmt: skip
    assert raw["rope_scaling"]["factor"] == 2.0, "the checkpoint's own dict is left as it was"
    assert with_overrides(raw, {"rope_scaling": None})["rope_scaling"] is None
    plain = ModelConfig.from_model_path(tiny_llama_dir)
    longer = ModelConfig.from_model_path(
        tiny_llama_dir, {"max_position_embeddings": 2 * plain.max_position_embeddings}
    )
    assert longer.max_position_embeddings == 2 * plain.max_position_embeddings
    assert longer.hidden_size == plain.hidden_size


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_grouped_gemm_equals_its_loop_over_experts(
    tiny_model_factory, arch: str
) -> None:
    """The CPU's grouped GEMM over the tokens sorted by expert and the loop over experts (the
    other devices' path) give the same logits, and each expert is its checkpoint tensors."""
    model_dir = tiny_model_factory(arch)
    ours = load_ours(model_dir)
    moe_blocks = [m for m in ours.modules() if isinstance(m, SparseMoe)]
    assert moe_blocks
    grouped = prefill_logits(ours, PROMPTS[2])
    for block in moe_blocks:
        block.grouped = False
    torch.testing.assert_close(prefill_logits(ours, PROMPTS[2]), grouped, atol=1e-5, rtol=1e-5)
    tensors = load_file(model_dir / "model.safetensors")
    first = moe_blocks[0]
    prefix = "model.layers.0." + ("block_sparse_moe" if arch == "mixtral" else "mlp")
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    size = first.experts_gate_up.shape[1] // 2
    gate, up, down = (tensors[f"{prefix}.experts.3.{name}.weight"] for name in names)
    assert torch.equal(first.experts_gate_up[3, :size], gate)
    assert torch.equal(first.experts_gate_up[3, size:], up)
    assert torch.equal(first.experts_down[3], down)


def test_a_multimodal_gemma3_skips_its_vision_tower_but_not_a_stray_weight(
    tiny_model_factory, tmp_path: Path
) -> None:
    model_dir = copy_model(tiny_model_factory("gemma3_mm"), tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    assert any(name.startswith("vision_tower.") for name in tensors)
    load_ours(model_dir)  # the vision tower and projector are skipped

    def add_stray(tensors: dict) -> None:
        tensors["image_newline"] = torch.zeros(4)

    rewrite_weights(model_dir, add_stray)
    with pytest.raises(ModelFileError, match="unexpected weight 'image_newline'"):
        load_ours(model_dir)
