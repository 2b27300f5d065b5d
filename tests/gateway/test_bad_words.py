"""vLLM's ``bad_words`` on both APIs: each word reaches the nodes as its token spellings at the
start of a text and after a space; too many words, an empty one, or a token sequence outside
the vocabulary is refused naming the field before any node is asked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.text.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, gateway_pb2
from services.bad_words import bad_words_token_ids
from support.fake_gateway import FakeGateway
from support.openai_app import MODEL, Served, assert_error, start


def spellings(tokenizer: Tokenizer, text: str) -> set[tuple[int, ...]]:
    return {
        tuple(tokenizer.encode(text, add_special_tokens=False)),
        tuple(tokenizer.encode(" " + text, add_special_tokens=False)),
    }


@pytest.fixture(scope="module")
def served(tokenizer: Tokenizer) -> Iterator[Served]:
    served, server = start(tokenizer)
    yield served
    server.stop()


def test_each_word_is_banned_at_the_start_and_after_a_space(tokenizer: Tokenizer) -> None:
    words = bad_words_token_ids(tokenizer.encode_text, ["hello", "  world", "hello"])
    # Leading whitespace is stripped first; a repeated spelling is kept once.
    assert set(words) == spellings(tokenizer, "hello") | spellings(tokenizer, "world")
    assert len(words) == len(set(words))
    # The two spellings differ in this vocabulary (the test would prove nothing otherwise).
    assert len(spellings(tokenizer, "hello")) == 2
    # A word of only whitespace is banned as itself, not as the space its stripping leaves.
    (newline, *_) = bad_words_token_ids(tokenizer.encode_text, ["\n"])
    assert newline == tuple(tokenizer.encode("\n", add_special_tokens=False))


def test_completions_and_chat_send_the_spellings_to_the_nodes(served: Served) -> None:
    body = {"model": MODEL, "prompt": "x", "bad_words": ["hello"], "n": 2}
    assert served.post("/v1/completions", body).status_code == 200
    expected = spellings(served.tokenizer, "hello")
    for request in served.generator.requests[-2:]:  # every choice
        assert set(request.sampling.bad_words_token_ids) == expected
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "bad_words": ["a b"]}
    assert served.post("/v1/chat/completions", chat).status_code == 200
    sent = served.generator.requests[-1].sampling.bad_words_token_ids
    assert set(sent) == spellings(served.tokenizer, "a b")


@pytest.mark.parametrize(
    ("words", "param"),
    [
        ([""], "bad_words[0]"),
        (["w"] * 65, "bad_words"),
        (["w" * 257], "bad_words"),
        ("w", "bad_words"),
    ],
)
def test_bad_word_lists_are_refused(served: Served, words: object, param: str) -> None:
    before = len(served.generator.requests)
    body = {"model": MODEL, "prompt": "x", "bad_words": words}
    assert_error(served.post("/v1/completions", body), 400, param)
    assert len(served.generator.requests) == before


def test_grpc_takes_words_and_token_sequences(tiny_llama_dir: Path) -> None:
    served = FakeGateway.start(tiny_llama_dir)
    try:
        tokenizer = served.gateway.frontend.tokenizer
        sampling = common_pb2.SamplingParams(
            bad_words_token_ids=[common_pb2.TokenSequence(ids=[5, 6])]
        )
        request = gateway_pb2.GatewayGenerateRequest(
            text="hi", sampling=sampling, bad_words=["hello"]
        )
        code, details, _ = served.call(request)
        assert code is grpc.StatusCode.OK, details
        sent = [tuple(word.ids) for word in served.node.samplings[-1].bad_words_token_ids]
        assert sent[0] == (5, 6) and set(sent[1:]) == spellings(tokenizer, "hello")

        vocab = tokenizer.vocab_size
        request.sampling.bad_words_token_ids[0].ids[:] = [5, vocab]
        code, details, _ = served.call(request)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.bad_words_token_ids[0]" in details and str(vocab) in details
        for bad in ([common_pb2.TokenSequence()], [common_pb2.TokenSequence(ids=[5])] * 65, []):
            del request.sampling.bad_words_token_ids[:]
            request.sampling.bad_words_token_ids.extend(bad)
            request.bad_words[:] = [""] if not bad else ["ok"]
            code, details, _ = served.call(request)
            assert code is grpc.StatusCode.INVALID_ARGUMENT
            assert "bad_words" in details, details
        assert served.node.running == 0
    finally:
        served.close()


def test_bad_words_that_ban_every_allowed_token_are_refused_before_routing(
    served: Served, tokenizer: Tokenizer
) -> None:
    """The engine would refuse it (no token could be sampled); the gateway does first, naming
    the field its client set."""
    (word,) = {ids for ids in spellings(tokenizer, "hello") if len(ids) == 1} or {None}
    assert word is not None, "the test needs a one-token spelling of 'hello'"
    before = len(served.generator.requests)
    body = {"model": MODEL, "prompt": "x", "bad_words": ["hello"], "allowed_token_ids": list(word)}
    assert_error(served.post("/v1/completions", body), 400, "bad_words")
    assert len(served.generator.requests) == before


def test_grpc_refuses_bad_words_that_ban_every_allowed_token(tiny_llama_dir: Path) -> None:
    served = FakeGateway.start(tiny_llama_dir)
    try:
        sampling = common_pb2.SamplingParams(
            allowed_token_ids=[5], bad_words_token_ids=[common_pb2.TokenSequence(ids=[5])]
        )
        request = gateway_pb2.GatewayGenerateRequest(text="hi", sampling=sampling)
        code, details, _ = served.call(request)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("sampling.bad_words_token_ids"), details
        assert not served.node.samplings  # refused before any node was asked
        request.sampling.allowed_token_ids.append(6)  # one allowed token left: served
        code, details, _ = served.call(request)
        assert code is grpc.StatusCode.OK, details
    finally:
        served.close()
