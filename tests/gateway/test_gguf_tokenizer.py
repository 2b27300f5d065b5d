"""The gateway's tokenizer read from a GGUF file equals the one it was converted from, and equals
transformers' own GGUF tokenizer on SmolLM2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gateway.config import model_max_len
from gateway.text.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! How are you?",
    "  leading spaces\n\nnew lines\ttabs  ",
    "héllo wörld 日本語 😀",
    "I'm sure they'll say it's 2024, or 3.14159",
    "<|im_start|>user\nhi<|im_end|>",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name three colours."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "And two more?"},
    ],
]


def test_a_converted_tiny_model_tokenizes_as_its_source(tiny_gguf_factory) -> None:
    gguf_path = tiny_gguf_factory("qwen3", "F16")
    ours = Tokenizer.from_model_dir(gguf_path)
    source = Tokenizer.from_model_dir(gguf_path.parent / "hf")
    for text in TEXTS:
        ids = source.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == source.decode(ids)
        assert [ours.token_bytes(i) for i in ids] == [source.token_bytes(i) for i in ids]
    for messages in CHATS:
        assert ours.encode_chat(messages) == source.encode_chat(messages)
    assert ours.eos_token_ids == source.eos_token_ids
    assert ours.special_tokens.items() <= source.special_tokens.items()
    assert model_max_len(gguf_path) == model_max_len(gguf_path.parent / "hf")


def test_smollm2_tokenizer_equals_transformers_gguf_tokenizer(smollm2_gguf: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_model_dir(smollm2_gguf)
    reference = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    for messages in CHATS:
        expected = reference.apply_chat_template(messages, add_generation_prompt=True)
        expected = expected if isinstance(expected, list) else expected["input_ids"]
        assert ours.encode_chat(messages) == expected
    assert ours.eos_token_ids == (reference.convert_tokens_to_ids("<|im_end|>"),)
    assert model_max_len(smollm2_gguf) == 8192


def test_reading_a_gguf_tokenizer_imports_no_torch_nor_numpy(tiny_gguf_factory) -> None:
    gguf_path = tiny_gguf_factory("llama", "F16")
    code = (
        "import sys; from gateway.text.tokenizer import Tokenizer; from gateway.config import "
        f"model_max_len; t = Tokenizer.from_model_dir({str(gguf_path)!r}); "
        f"model_max_len(__import__('pathlib').Path({str(gguf_path)!r})); "
        "assert t.encode('hello world'); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
