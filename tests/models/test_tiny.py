"""The tiny-checkpoint builder writes what Hugging Face itself loads, deterministically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from services.models.tiny import ARCHS, build_tiny_model

PROMPT = "The model answered the question about the river, café and 日本語."


def load_hf(model_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model.eval(), tokenizer


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_writes_hugging_face_files(tiny_llama_dir: Path) -> None:
    names = {p.name for p in tiny_llama_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    config = read_json(tiny_llama_dir / "config.json")
    assert config["dtype"] == "float32"
    assert config["vocab_size"] == 4096
    assert "chat_template" in read_json(tiny_llama_dir / "tokenizer_config.json")
    weights = load_file(tiny_llama_dir / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}


@pytest.mark.parametrize("arch", ARCHS)
def test_hugging_face_loads_it_with_spread_logits(tiny_model_factory, arch: str) -> None:
    model, tokenizer = load_hf(tiny_model_factory(arch))
    input_ids = torch.tensor([tokenizer.encode(PROMPT)])

    with torch.no_grad():
        logits = model(input_ids).logits  # [1, num_tokens, vocab_size]

    assert logits.shape == (1, input_ids.shape[1], 4096)
    # HF's default init gives std ~0.02 here; greedy parity needs clearly separated logits.
    assert logits.std(dim=-1).min() > 1.0


def test_special_token_ids_agree(tiny_llama_dir: Path) -> None:
    _, tokenizer = load_hf(tiny_llama_dir)
    config = read_json(tiny_llama_dir / "config.json")
    generation = read_json(tiny_llama_dir / "generation_config.json")
    assert len(tokenizer) == config["vocab_size"] == 4096
    for key, token_id in [
        ("bos_token_id", tokenizer.bos_token_id),
        ("eos_token_id", tokenizer.eos_token_id),
        ("pad_token_id", tokenizer.pad_token_id),
    ]:
        assert config[key] == generation[key] == token_id
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a", seed=7)
    again = build_tiny_model(tmp_path / "b", seed=7)
    other = build_tiny_model(tmp_path / "c", seed=8)

    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes()
    first_weights = load_file(first / "model.safetensors")
    other_weights = load_file(other / "model.safetensors")
    assert not torch.equal(
        first_weights["model.embed_tokens.weight"], other_weights["model.embed_tokens.weight"]
    )
    # The tokenizer belongs to the size, not to the weight seed.
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_tokenizer_round_trips_multibyte_text(tiny_llama_dir: Path) -> None:
    _, tokenizer = load_hf(tiny_llama_dir)
    text = "Hello world! naïve café, 東京 and 日本語 🙂 → 12345.\nA rare 鬱 and 🐙."

    ids = tokenizer.encode(text)

    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Rare characters stay split into byte tokens: detokenizers must handle partial UTF-8.
    assert len(tokenizer.encode("鬱", add_special_tokens=False)) > 1


def test_chat_template_renders_chatml(tiny_llama_dir: Path) -> None:
    _, tokenizer = load_hf(tiny_llama_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]

    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_sharded_checkpoint_has_an_index(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama", sharded=True)

    index = read_json(model_dir / "model.safetensors.index.json")

    shard_names = set(index["weight_map"].values())
    assert len(shard_names) > 1
    assert all((model_dir / name).is_file() for name in shard_names)
    assert not (model_dir / "model.safetensors").exists()
    model, _ = load_hf(model_dir)
    unsharded, _ = load_hf(tiny_model_factory("llama"))
    for (name, param), (_, expected) in zip(
        model.state_dict().items(), unsharded.state_dict().items(), strict=True
    ):
        assert torch.equal(param, expected), name


def test_llama_uses_llama3_rope_scaling(tiny_llama_dir: Path) -> None:
    config = read_json(tiny_llama_dir / "config.json")
    assert config["tie_word_embeddings"] is False
    assert config["rope_parameters"]["rope_type"] == "llama3"
    model, _ = load_hf(tiny_llama_dir)

    head_dim = config["head_dim"]
    unscaled = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = model.model.rotary_emb.inv_freq

    # llama3 scaling keeps high frequencies and divides the lowest ones by the factor.
    torch.testing.assert_close(inv_freq[0], unscaled[0])
    torch.testing.assert_close(inv_freq[-1], unscaled[-1] / 8.0)


def test_qwen2_ties_embeddings_and_has_qkv_bias(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen2")
    config = read_json(model_dir / "config.json")
    weights = load_file(model_dir / "model.safetensors")

    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in weights
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert weights[f"model.layers.0.self_attn.{proj}.bias"].abs().sum() > 0
    model, _ = load_hf(model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_qwen3_has_qk_norm_and_explicit_head_dim(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3")
    config = read_json(model_dir / "config.json")
    weights = load_file(model_dir / "model.safetensors")

    assert config["head_dim"] == 32
    assert config["tie_word_embeddings"] is False
    assert torch.equal(weights["model.layers.0.self_attn.q_norm.weight"], torch.ones(32))
    assert torch.equal(weights["model.layers.0.self_attn.k_norm.weight"], torch.ones(32))
    assert "lm_head.weight" in weights


def test_mistral_has_no_sliding_window(tiny_model_factory) -> None:
    config = read_json(tiny_model_factory("mistral") / "config.json")

    assert config["model_type"] == "mistral"
    assert config["sliding_window"] is None
    assert config["tie_word_embeddings"] is False


def test_rejects_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        build_tiny_model(tmp_path, arch="gpt2")
