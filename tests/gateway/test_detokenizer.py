"""IncrementalDetokenizer: whole characters only, and the same text as a full decode."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.tokenizer import Tokenizer

# Rare characters (鿋, 𝄞, 🦜) stay split into byte tokens in the tiny vocabulary; the others are
# learned whole or partly.
MULTIBYTE_TEXTS = (
    "é",
    "😀",
    "日本語 東京 鿋 漢字",
    "naïve café 🦜🚀 → €5 𝄞",
    "a😀b鿋c",
)
SP_CORPUS = (
    "Hello world, this is a small corpus for a tiny sentencepiece style vocabulary.",
    "The quick brown fox jumps over the lazy dog.",
)

DetokenizerFactory = Callable[..., IncrementalDetokenizer]


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A Llama-2-style vocabulary: "▁" word starts, byte fallback, leading space stripped."""
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    backend = HfTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    backend.train_from_iterator(list(SP_CORPUS) * 20, trainer)
    # The byte tokens belong to the model's vocabulary, not to the special added tokens.
    data = json.loads(backend.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<0x")]
    data["pre_tokenizer"] = None
    backend = HfTokenizer.from_str(json.dumps(data))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    model_dir = tmp_path_factory.mktemp("sp-tokenizer")
    backend.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_model_dir(model_dir)


def detokenize(
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    skip_special_tokens: bool = True,
    chunk_size: int = 1,
) -> list[str]:
    """Every piece ``add`` returned, one per chunk, then what ``flush`` returned."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [
        detokenizer.add(output_ids[start : start + chunk_size])
        for start in range(0, len(output_ids), chunk_size)
    ]
    return [*pieces, detokenizer.flush()]


def random_ids(rng: random.Random, tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    # Half are single-byte tokens (ids below 300 are mostly bytes), so partial characters abound.
    return [
        rng.randrange(tokenizer.vocab_size) if rng.random() < 0.5 else rng.randrange(300)
        for _ in range(num_tokens)
    ]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_split_characters_never_come_out_broken(tokenizer: Tokenizer, text: str) -> None:
    prompt_ids = tokenizer.encode("Say it:")
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = detokenize(tokenizer, prompt_ids, output_ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_partial_character_is_held_until_complete(tokenizer: Tokenizer) -> None:
    output_ids = tokenizer.encode("x鿋", add_special_tokens=False)
    assert len(output_ids) == 4  # "x" and the three bytes of a rare CJK character
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say it:"))
    assert detokenizer.add(output_ids[:2]) == "x"
    assert detokenizer.num_held_tokens == 1
    assert detokenizer.add(output_ids[2:3]) == ""
    assert detokenizer.add(output_ids[3:]) == "鿋"
    assert detokenizer.num_held_tokens == 0
    assert detokenizer.flush() == ""


def test_flush_releases_a_character_that_never_completed(tokenizer: Tokenizer) -> None:
    # The model stopped two bytes into a four-byte emoji.
    output_ids = [*tokenizer.encode("ok", False), *tokenizer.encode("🦜", False)[:2]]
    pieces = detokenize(tokenizer, tokenizer.encode("Hi"), output_ids)
    assert pieces[-1] == tokenizer.decode(output_ids)[len("ok") :]
    assert pieces[-1].endswith("\ufffd")
    assert "".join(pieces) == tokenizer.decode(output_ids)


@pytest.mark.parametrize("chunk_size", [1, 3])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_join_to_the_full_decode(
    tokenizer: Tokenizer, chunk_size: int, skip_special_tokens: bool
) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        prompt_ids = random_ids(rng, tokenizer, rng.randrange(0, 30))
        output_ids = random_ids(rng, tokenizer, rng.randrange(1, 40))
        pieces = detokenize(tokenizer, prompt_ids, output_ids, skip_special_tokens, chunk_size)
        assert "".join(pieces) == tokenizer.decode(output_ids, skip_special_tokens), (
            prompt_ids,
            output_ids,
        )


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    output_ids = [*tokenizer.encode("hi", False), *tokenizer.encode("<|im_end|>", False)]
    prompt_ids = tokenizer.encode("<|im_start|>assistant\n")
    assert "".join(detokenize(tokenizer, prompt_ids, output_ids)) == "hi"
    kept = detokenize(tokenizer, prompt_ids, output_ids, skip_special_tokens=False)
    assert "".join(kept) == "hi<|im_end|>"


def test_sentencepiece_token_text_and_bytes(sp_tokenizer: Tokenizer) -> None:
    # Tokenizer behaviour, tested here where the SentencePiece-style vocabulary is built.
    hello_id = sp_tokenizer.backend.token_to_id("\u2581Hello")
    assert sp_tokenizer.encode("Hello", add_special_tokens=False) == [hello_id]
    assert sp_tokenizer.decode([hello_id]) == "Hello"
    # vLLM's logprobs restore the word-start space decode() strips from a lone token.
    assert sp_tokenizer.token_text(hello_id) == " Hello"
    assert sp_tokenizer.token_bytes(hello_id) == b" Hello"
    ids = sp_tokenizer.encode("a 日本", add_special_tokens=False)
    assert b"".join(sp_tokenizer.token_bytes(i) for i in ids) == " a 日本".encode()


def test_sentencepiece_keeps_the_first_words_space(sp_tokenizer: Tokenizer) -> None:
    prompt_ids = sp_tokenizer.encode("Hello")
    output_ids = sp_tokenizer.encode("world fox", add_special_tokens=False)
    # Decoded alone the output loses its leading space; after the prompt it keeps it.
    assert sp_tokenizer.decode(output_ids) == "world fox"
    assert "".join(detokenize(sp_tokenizer, prompt_ids, output_ids)) == " world fox"


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_sentencepiece_byte_fallback_never_breaks(sp_tokenizer: Tokenizer, text: str) -> None:
    output_ids = sp_tokenizer.encode(text, add_special_tokens=False)
    pieces = detokenize(sp_tokenizer, sp_tokenizer.encode("The fox said"), output_ids)
    assert "".join(pieces) == " " + text
    assert not any("\ufffd" in piece for piece in pieces)


def test_sentencepiece_random_ids_continue_the_prompt(sp_tokenizer: Tokenizer) -> None:
    # Word pieces only: a run of byte tokens that is not valid UTF-8 decodes to one U+FFFD per
    # byte, valid ASCII ones included, so later bytes rewrite earlier text (no stream can match).
    word_ids = [
        token_id
        for token_id in range(sp_tokenizer.vocab_size)
        if not sp_tokenizer.backend.id_to_token(token_id).startswith("<0x")
    ]
    rng = random.Random(99)
    for _ in range(300):
        prompt_ids = rng.choices(word_ids, k=rng.randrange(1, 30))
        output_ids = rng.choices(word_ids, k=rng.randrange(1, 40))
        pieces = detokenize(sp_tokenizer, prompt_ids, output_ids)
        # The text the output adds to the prompt's: the invariant behind vLLM's offsets.
        prompt_text = sp_tokenizer.decode(prompt_ids)
        full_text = sp_tokenizer.decode([*prompt_ids, *output_ids])
        assert "".join(pieces) == full_text[len(prompt_text) :], (prompt_ids, output_ids)


def test_invalid_byte_runs_restart_the_stream(
    sp_tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    # <0x59> ("Y") then <0xE6> (a lead byte) then a word: the full decode turns "Y" into U+FFFD
    # once <0xE6> arrives, which DecodeStream reports as an invalid prefix.
    y_id = sp_tokenizer.encode("Y", False)[-1]
    assert sp_tokenizer.backend.id_to_token(y_id) == "<0x59>"
    lead_id = sp_tokenizer.encode("日", False)[-3]
    assert sp_tokenizer.backend.id_to_token(lead_id) == "<0xE6>"
    output_ids = [y_id, lead_id, *sp_tokenizer.encode("fox", False)]
    with caplog.at_level(logging.WARNING, logger="gateway.text.detokenizer"):
        pieces = detokenize(sp_tokenizer, sp_tokenizer.encode("The"), output_ids)
    assert "restarted" in caplog.text
    assert pieces[0] == "Y"
    assert "".join(pieces).endswith(" fox")
