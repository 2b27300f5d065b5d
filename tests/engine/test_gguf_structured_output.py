"""Guided decoding on GGUF checkpoints, which carry no tokenizer.json: llguidance gets the tokenizer
the gateway builds from the file's metadata (``services.gguf_tokenizer``), so the ids it masks are
the model's; a constrained request on a GGUF model yields output its grammar allows; and a model
without a readable tokenizer is refused with an error saying so."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from gateway.text.tokenizer import Tokenizer
from services.engine import LLM, SamplingParams
from services.engine.structured_output import StructuredOutputs
from services.guided_decoding import GuidedDecoding, GuidedKind
from services.models.config import ModelConfig
from services.models.gguf_file import open_gguf
from support.gguf_files import close_gguf, sentencepiece_gguf

TEXTS = [
    "Hello, world! How are you?",
    "  leading spaces\n\nnew lines\ttabs  ",
    "héllo wörld 日本語 😀",
    "I'm sure they'll say it's 2024, or 3.14159",
    '{"name":"Tom","age":12345,"tags":["a b"]}',
]
CHOICES = ["yes", "no", "maybe not"]


def structured_outputs(model_path: Path) -> StructuredOutputs:
    config = ModelConfig.from_model_path(model_path)
    return StructuredOutputs(model_path, config.vocab_size, config.eos_token_ids)


def assert_llguidance_sees_the_model_tokenizer(model_path: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(model_path)
    llg = structured_outputs(model_path).llg_tokenizer()
    for text in TEXTS:
        assert llg.tokenize_str(text) == tokenizer.encode(text, add_special_tokens=False), text
    # The mask is computed from each token's bytes: every ordinary token stands for the same
    # bytes to llguidance as to the gateway's detokenizer.
    ordinary = [i for i in range(tokenizer.vocab_size) if not llg.is_special_token(i)]
    assert len(ordinary) > tokenizer.vocab_size // 2
    assert [llg.decode_bytes([i]) for i in ordinary] == [tokenizer.token_bytes(i) for i in ordinary]
    assert llg.eos_tokens == list(tokenizer.eos_token_ids)


def test_a_tiny_gguf_gives_llguidance_the_tokenizer_of_its_source(tiny_gguf_factory) -> None:
    gguf_path = tiny_gguf_factory("qwen3", "F16")
    assert_llguidance_sees_the_model_tokenizer(gguf_path)
    # ...which is the tokenizer.json it was converted from, id for id.
    from_source = structured_outputs(gguf_path.parent / "hf").llg_tokenizer()
    from_gguf = structured_outputs(gguf_path).llg_tokenizer()
    for text in TEXTS:
        assert from_gguf.tokenize_str(text) == from_source.tokenize_str(text), text


def write_tokenizer_gguf(path: Path, tokens: list[str], merges: list[str], pre: str) -> Path:
    """A GGUF holding only a byte-level BPE tokenizer (and one tensor, as every GGUF has)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    close_gguf(writer)
    return path


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe", "qwen2"])
def test_every_known_pre_tokenizer_splits_alike_for_llguidance(
    tiny_gguf_factory, tmp_path: Path, pre: str
) -> None:
    # The Split expressions of Llama 3 and Qwen2 (lookahead, NFC) run in llguidance's copy of
    # the tokenizers library, not the gateway's: both must split the same way.
    source = open_gguf(tiny_gguf_factory("qwen3", "F16"))
    tokens = source.value("tokenizer.ggml.tokens")
    path = write_tokenizer_gguf(
        tmp_path / f"{pre}.gguf", tokens, source.value("tokenizer.ggml.merges"), pre
    )
    tokenizer = Tokenizer.from_model_dir(path)
    llg = StructuredOutputs(path, len(tokens), [0]).llg_tokenizer()
    for text in [*TEXTS, "x  \n\n  y 1234567 Ｆｕｌｌ e\u0301"]:
        assert llg.tokenize_str(text) == tokenizer.encode(text, add_special_tokens=False), text


def test_smollm2_gives_llguidance_the_gateway_tokenizer(smollm2_gguf: Path) -> None:
    assert_llguidance_sees_the_model_tokenizer(smollm2_gguf)
    # The directory `make run` names works as well as the file.
    assert_llguidance_sees_the_model_tokenizer(smollm2_gguf.parent)


def test_a_tiny_gguf_model_generates_what_its_grammar_allows(tiny_gguf_factory) -> None:
    gguf_path = tiny_gguf_factory("qwen3", "F16")
    tokenizer = Tokenizer.from_model_dir(gguf_path)
    llm = LLM(gguf_path, dtype="float32", max_model_len=256, kv_cache_memory=4 << 20)
    prompt = tokenizer.encode("Answer in JSON.")
    # Random weights: left alone the model writes no JSON, so the grammar is doing the work.
    (free,) = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(free.token_ids))
    for seed in range(3):
        params = SamplingParams(max_tokens=60, seed=seed, guided=GuidedDecoding.choice(CHOICES))
        (out,) = llm.generate([prompt], params)
        assert tokenizer.decode(out.token_ids) in CHOICES and out.finish_reason == "stop"
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=60, seed=0, guided=GuidedDecoding.json_schema(schema))
    (out,) = llm.generate([prompt], params)
    assert out.finish_reason == "stop"
    assert json.loads(tokenizer.decode(out.token_ids)).keys() == {"n"}


def test_smollm2_answers_json_object_and_choice(smollm2_gguf: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(smollm2_gguf.parent)
    llm = LLM(smollm2_gguf.parent, dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    ask = "Describe a cat as a JSON object with its name and age."
    prompt = tokenizer.encode_chat([{"role": "user", "content": ask}])
    params = SamplingParams(
        max_tokens=80, temperature=0.0, guided=GuidedDecoding(GuidedKind.JSON_OBJECT)
    )
    (out,) = llm.generate([prompt], params)
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(tokenizer.decode(out.token_ids)), dict)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Is the sky blue?"}])
    params = SamplingParams(max_tokens=20, temperature=0.0, guided=GuidedDecoding.choice(CHOICES))
    (out,) = llm.generate([prompt], params)
    assert tokenizer.decode(out.token_ids) in CHOICES and out.finish_reason == "stop"


def test_a_model_without_a_tokenizer_is_named(tmp_path: Path) -> None:
    guided = GuidedDecoding(GuidedKind.JSON_OBJECT)
    with pytest.raises(ValueError, match=r"needs the model's tokenizer \(.*tokenizer\.json not"):
        StructuredOutputs(tmp_path, 100, [0]).compile(guided)
    spm = sentencepiece_gguf(tmp_path / "spm.gguf")
    with pytest.raises(ValueError, match=r"needs the model's tokenizer: .*tokenizer model 'llama'"):
        StructuredOutputs(spm, 3, [2]).compile(guided)
