"""A GGUF file with a SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: Llama 2,
TinyLlama, Mistral 7B v0.1) tokenizes as transformers' own GGUF tokenizer reads the same file
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), id for id and string for string, and a
tiny Llama carrying one is served by the engine with the gateway's ids.

No real SentencePiece GGUF is at hand offline: the vocabularies are written here, with byte tokens,
"▁" pieces, scores that tie and pieces that compete for the same text, so that the order of the
merges decides the ids.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.tokenizer import Tokenizer
from services.engine import LLM, SamplingParams
from services.engine.structured_output import StructuredOutputs
from support.gguf_files import close_gguf

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
CONTROL = ("<|im_start|>", "<|im_end|>")
USER_DEFINED = "<think>"
# llama.cpp's token types.
NORMAL, UNKNOWN, CONTROL_TYPE, USER_DEFINED_TYPE, BYTE = 1, 2, 3, 4, 6
METASPACE = "\u2581"
WORDS = (
    "hello world the quick brown fox jumps over lazy dog token tokens tokenizer piece pieces "
    "merge merges score scores sentence space spaces llama model models serve server hell low "
    "lower lowest new newer newest wide widest in int into inter internet café naïve"
).split()
CHARACTERS = "abcdefghijklmnopqrstuvwxyzHTWLM0123456789.,!?'-:()é"
# Llama 2's chat format, over the vocabulary's own special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
TEXTS = [
    "",
    " ",
    "  ",
    "\n",
    "hello",
    "hello world",
    "Hello World",
    "HELLO WORLD",
    " hello",
    "  hello",
    "hello ",
    "hello   world",
    "  leading and trailing  ",
    "hello\nworld",
    "\n\nnew lines\n",
    "tabs\tand\r\ncarriage returns",
    "the quick brown fox jumps over the lazy dog",
    "tokenizer tokens merge merges scores sentencepiece",
    "lowest newest widest internet into inter",
    "hellhello lowlower newnewer",
    "1234567890 and 3.14159, or 2024!",
    "punctuation: ?!.,;:'\"()[]{}<>@#$%^&*_+=|\\/~`",
    "café naïve é",
    "héllo wörld",
    "中文",
    "日本語 and 中文 mixed",
    "😀",
    "emoji 😀🎉 at the end 👍🏽",
    "\u00a0non-breaking\u2003spaces",
    f"{METASPACE}already marked{METASPACE}",
    f"a{METASPACE}b {METASPACE}{METASPACE}c",
    "<0x41> is not a byte token in text",
    BOS,
    EOS,
    UNK,
    f"{BOS}hello{EOS}",
    f"hello {BOS} world",
    f"{BOS} hello",
    f"{UNK} unknown {UNK}",
    f"{CONTROL[0]}user\nhi{CONTROL[1]}\n{CONTROL[0]}assistant\n",
    f"{USER_DEFINED}let me think{USER_DEFINED} done",
    f"x{USER_DEFINED}y",
    "<s",
    "s>",
    "<|im_start",
]
CHATS = [
    [{"role": "user", "content": "hello world"}],
    [
        {"role": "user", "content": "the quick brown fox?"},
        {"role": "assistant", "content": "jumps over the lazy dog."},
        {"role": "user", "content": "and 中文 😀"},
    ],
]


@dataclass(frozen=True)
class SpmVocabulary:
    """A SentencePiece vocabulary as llama.cpp's converter writes one into a GGUF file."""

    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)
    """Keys other than the vocabulary: add_bos_token, add_space_prefix, merges..."""


def make_spm_vocabulary(num_tokens: int, seed: int = 0) -> SpmVocabulary:
    """``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens, single characters, then pieces of
    "▁word" for the words of WORDS and invented ones until ``num_tokens``: each whole word, and
    about half of its other pieces, so that a word is reached by some orders of merges and not
    others. Scores come from a few values, so that merges tie. Two control tokens and a
    user-defined one come last."""
    rng = random.Random(seed)
    head = [(UNK, 0.0, UNKNOWN), (BOS, 0.0, CONTROL_TYPE), (EOS, 0.0, CONTROL_TYPE)]
    head += [(f"<0x{byte:02X}>", 0.0, BYTE) for byte in range(256)]
    tail = [(token, 0.0, CONTROL_TYPE) for token in CONTROL]
    tail.append((USER_DEFINED, 0.0, USER_DEFINED_TYPE))
    num_pieces = num_tokens - len(head) - len(tail)
    pieces: dict[str, None] = dict.fromkeys([METASPACE, *CHARACTERS])
    syllables = ["ka", "lo", "mi", "ner", "sta", "ve", "qu", "ion", "tr", "ph"]
    invented = (
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in itertools.count()
    )
    for word in itertools.chain(WORDS, invented):
        marked = METASPACE + word
        for length in range(2, len(marked)):
            for start in range(len(marked) - length + 1):
                if rng.random() < 0.5:
                    pieces.setdefault(marked[start : start + length])
        pieces.setdefault(marked)
        if len(pieces) >= num_pieces:
            break
    body = list(pieces)[:num_pieces]
    # Few distinct scores: many merged tokens tie, and the tie-breaks decide the ids.
    scored = [(piece, -float(rng.randint(0, 12)), NORMAL) for piece in body]
    entries = head + scored + tail
    assert len(entries) == num_tokens == len({token for token, _, _ in entries})
    return SpmVocabulary(
        tokens=[token for token, _, _ in entries],
        scores=[score for _, score, _ in entries],
        token_types=[kind for _, _, kind in entries],
    )


def add_spm_tokenizer(writer: gguf.GGUFWriter, vocabulary: SpmVocabulary) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_scores(vocabulary.scores)
    writer.add_token_types(vocabulary.token_types)
    writer.add_unk_token_id(vocabulary.tokens.index(UNK))
    writer.add_bos_token_id(vocabulary.tokens.index(BOS))
    writer.add_eos_token_id(vocabulary.tokens.index(EOS))
    writer.add_chat_template(CHAT_TEMPLATE)
    adders = {
        "add_bos_token": writer.add_add_bos_token,
        "add_eos_token": writer.add_add_eos_token,
        "add_space_prefix": writer.add_add_space_prefix,
        "merges": writer.add_token_merges,
    }
    for key, value in vocabulary.metadata.items():
        adders[key](value)


def write_spm_gguf(path: Path, vocabulary: SpmVocabulary) -> Path:
    """A GGUF holding the vocabulary (and one tensor, as every GGUF has)."""
    writer = gguf.GGUFWriter(path, "llama")
    add_spm_tokenizer(writer, vocabulary)
    writer.add_tensor("token_embd.weight", np.zeros((len(vocabulary.tokens), 4), np.float32))
    close_gguf(writer)
    return path


def transformers_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def random_id_sequences(vocab_size: int, count: int) -> list[list[int]]:
    """Ids in any order: bytes that form no character, special tokens anywhere, "▁" first."""
    rng = random.Random(1)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(count)]


def assert_same_as_transformers(path: Path) -> int:
    """Compare encode and decode with transformers' tokenizer of ``path``; returns the number of
    texts compared."""
    ours = Tokenizer.from_model_dir(path)
    reference = transformers_tokenizer(path)
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == reference.encode(text, add_special_tokens=add_special_tokens), (
                text,
                add_special_tokens,
                reference.convert_ids_to_tokens(ids),
            )
            for skip in (True, False):
                expected = reference.decode(ids, skip_special_tokens=skip)
                assert ours.decode(ids, skip_special_tokens=skip) == expected, (text, skip)
    # "▁" spelled in byte tokens is text, not a space (the decoder maps "▁" before bytes).
    marks = [reference.convert_tokens_to_ids(f"<0x{byte:02X}>") for byte in METASPACE.encode()]
    hello = reference.encode("hello", add_special_tokens=False)
    for ids in [*random_id_sequences(len(reference), 50), marks + hello, hello + marks + hello]:
        for skip in (True, False):
            expected = reference.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == expected, (ids, skip)
    for messages in CHATS:
        expected = reference.apply_chat_template(messages, tokenize=True)
        expected = expected if isinstance(expected, list) else expected["input_ids"]
        assert ours.encode_chat(messages, add_generation_prompt=False) == expected
    assert ours.vocab_size == len(reference)
    # The merges, in their order: where the ids above would not tell a tie broken otherwise.
    reference_model = json.loads(reference.backend_tokenizer.to_str())["model"]
    assert json.loads(ours.backend.to_str())["model"]["merges"] == reference_model["merges"]
    assert ours.eos_token_ids == (reference.eos_token_id,)
    assert ours.special_tokens == {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    return len(TEXTS)


@pytest.fixture(scope="module")
def vocabulary() -> SpmVocabulary:
    return make_spm_vocabulary(480)


def test_the_vocabulary_has_competing_pieces_and_tied_scores(vocabulary: SpmVocabulary) -> None:
    tokens = set(vocabulary.tokens)
    assert {f"{METASPACE}hello", f"{METASPACE}world", "é", "<0xE4>"} <= tokens
    assert "中" not in tokens  # byte fallback
    marked = METASPACE + "tokenizer"
    inner = {marked[i:j] for i in range(len(marked)) for j in range(i + 2, len(marked))}
    assert 0 < len(inner & tokens) < len(inner)
    multi = [s for t, s in zip(vocabulary.tokens, vocabulary.scores, strict=True) if len(t) > 1]
    assert len(set(multi)) < len(multi) // 10


@pytest.mark.parametrize(
    "metadata",
    [
        {},  # BOS by default, as llama.cpp and transformers add it to a "llama" vocabulary
        {"add_bos_token": True, "add_eos_token": False, "add_space_prefix": True},
        {"add_bos_token": False, "add_eos_token": True},
        {"add_bos_token": True, "add_eos_token": True},
    ],
    ids=["defaults", "explicit-defaults", "eos-only", "bos-and-eos"],
)
def test_a_sentencepiece_gguf_tokenizes_as_transformers(
    tmp_path: Path, vocabulary: SpmVocabulary, metadata: dict[str, Any]
) -> None:
    path = write_spm_gguf(
        tmp_path / "spm.gguf",
        SpmVocabulary(vocabulary.tokens, vocabulary.scores, vocabulary.token_types, metadata),
    )
    assert assert_same_as_transformers(path) >= 40


def test_the_files_merges_win_over_its_scores(tmp_path: Path, vocabulary: SpmVocabulary) -> None:
    scored = Tokenizer.from_model_dir(write_spm_gguf(tmp_path / "scored.gguf", vocabulary))
    # The merges the scores imply, in reverse: the longest pieces are now merged last.
    derived = json.loads(scored.backend.to_str())["model"]["merges"]
    merges = [" ".join(pair) for pair in reversed(derived)]
    path = write_spm_gguf(
        tmp_path / "merges.gguf",
        SpmVocabulary(
            vocabulary.tokens, vocabulary.scores, vocabulary.token_types, {"merges": merges}
        ),
    )
    assert assert_same_as_transformers(path) >= 40
    # Words the vocabulary lacks whole ("▁lowest") are cut where the merge order says.
    reordered = Tokenizer.from_model_dir(path)
    assert [reordered.encode(text) != scored.encode(text) for text in TEXTS].count(True) >= 3


def test_no_space_prefix_when_the_file_says_so(tmp_path: Path, vocabulary: SpmVocabulary) -> None:
    # transformers 5 ignores add_space_prefix; llama.cpp (and transformers 4) honour it, as here.
    prefixed = Tokenizer.from_model_dir(write_spm_gguf(tmp_path / "prefixed.gguf", vocabulary))
    bare = Tokenizer.from_model_dir(
        write_spm_gguf(
            tmp_path / "bare.gguf",
            SpmVocabulary(
                vocabulary.tokens,
                vocabulary.scores,
                vocabulary.token_types,
                {"add_space_prefix": False},
            ),
        )
    )
    for text in ("hello world", "the lazy dog", "中文 😀"):
        assert bare.encode(" " + text) == prefixed.encode(text)
        assert bare.encode(text) != prefixed.encode(text)
        assert bare.decode(bare.encode(" " + text)) == " " + text
        assert prefixed.decode(prefixed.encode(text)) == text


def test_a_sentencepiece_gguf_without_scores_or_merges_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "no-scores.gguf", "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([UNK, BOS, EOS, "a"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    close_gguf(writer)
    with pytest.raises(ValueError, match=r"no merges and none tokenizer\.ggml\.scores"):
        Tokenizer.from_model_dir(tmp_path / "no-scores.gguf")


@pytest.mark.parametrize("model", ["t5", "gemma4", "bert"])
def test_other_tokenizer_models_are_refused_by_name(tmp_path: Path, model: str) -> None:
    writer = gguf.GGUFWriter(tmp_path / f"{model}.gguf", "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list([UNK, BOS, EOS])
    writer.add_tensor("token_embd.weight", np.zeros((3, 4), np.float32))
    close_gguf(writer)
    with pytest.raises(ValueError, match=rf"tokenizer model '{model}'.*'gpt2'.*'llama'"):
        Tokenizer.from_model_dir(tmp_path / f"{model}.gguf")


def with_spm_vocabulary(source: Path, out: Path) -> Path:
    """``source``'s model (metadata and tensors) with a SentencePiece vocabulary of its own
    vocabulary size in place of its byte-level one."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    vocab_size = reader.fields[f"{arch}.vocab_size"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for name, reader_field in reader.fields.items():
        if name.startswith(("GGUF.", "tokenizer.")) or name == "general.architecture":
            continue
        main_type = reader_field.types[0]
        sub_type = reader_field.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, reader_field.contents(), main_type, sub_type)
    add_spm_tokenizer(writer, make_spm_vocabulary(vocab_size))
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data))
    close_gguf(writer)
    return out


def test_a_tiny_llama_with_a_sentencepiece_vocabulary_is_served(
    tiny_gguf_factory, tmp_path: Path
) -> None:
    path = with_spm_vocabulary(tiny_gguf_factory("llama", "F16"), tmp_path / "tiny-spm.gguf")
    reference = transformers_tokenizer(path)
    gateway = Tokenizer.from_model_dir(path)
    text = "the quick brown fox jumps over the lazy dog, 中文 😀"
    expected = reference.encode(text)
    assert expected[0] == reference.bos_token_id and len(expected) > 10
    assert gateway.encode(text) == expected
    llm = LLM(path, dtype="float32", max_model_len=64, max_num_seqs=2, kv_cache_memory=1 << 22)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate(text, params, use_tqdm=False)
    assert output.prompt_token_ids == expected
    assert len(output.token_ids) == 8
    # The text continues the prompt's, as the gateway streams it (and vLLM gives it): decoded
    # after the prompt, where decoding the output alone drops a word-start space.
    streamed = IncrementalDetokenizer(gateway, expected)
    as_served = streamed.add(output.token_ids) + streamed.flush()
    assert output.text == as_served
    full = reference.decode(expected + output.token_ids, skip_special_tokens=True)
    assert full.endswith(output.text)
    word = reference.convert_tokens_to_ids(f"{METASPACE}the")
    forced = SamplingParams(max_tokens=2, temperature=0.0, allowed_token_ids=[word])
    (spaced,) = llm.generate(text, forced, use_tqdm=False)
    assert spaced.token_ids == [word, word]
    assert reference.decode(spaced.token_ids, skip_special_tokens=True) == "the the"
    assert spaced.text == " the the"
    stopped = SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=[word], stop=["e t"])
    (cut,) = llm.generate(text, stopped, use_tqdm=False)
    assert cut.text == " th" and cut.stop_reason == "e t"
    # Guided decoding masks with the same ids: llguidance reads the tokenizer built here, and
    # computes the mask from each token's bytes.
    llg = StructuredOutputs(path, len(reference), list(gateway.eos_token_ids)).llg_tokenizer()
    ordinary = [i for i in range(gateway.vocab_size) if not llg.is_special_token(i)]
    assert len(ordinary) > gateway.vocab_size - 10  # not the added tokens
    assert [llg.decode_bytes([i]) for i in ordinary] == [gateway.token_bytes(i) for i in ordinary]
    # llguidance's tokenize_str prepends no "▁": given the space, it cuts as the gateway does.
    assert llg.tokenize_str(" " + text) == gateway.encode(text, add_special_tokens=False)
    assert llg.eos_tokens == [reference.eos_token_id]
