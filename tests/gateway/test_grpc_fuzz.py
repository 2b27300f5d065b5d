"""Hypothesis over the public gRPC API's request fields: whatever a client sends, the gateway
answers OK or a client-error status naming the problem — never UNKNOWN/INTERNAL, never a hang —
and no request is left running on the node behind it (a fake node, so examples are cheap)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.v1 import common_pb2, gateway_pb2
from support.fake_gateway import FakeGateway
from support.raw_grpc import refused_raw_call

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, -1.0, 1e30])
)
uint32 = st.integers(min_value=0, max_value=2**32 - 1)
small_uint = st.one_of(st.integers(min_value=0, max_value=64), uint32)


@st.composite
def sampling(draw) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        min_tokens=draw(small_uint),
        min_p=draw(floats),
        presence_penalty=draw(floats),
        frequency_penalty=draw(floats),
        stop_token_ids=draw(st.lists(uint32, max_size=4)),
        allowed_token_ids=draw(st.lists(st.one_of(uint32, st.integers(0, 100)), max_size=4)),
        ignore_eos=draw(st.booleans()),
        priority=draw(st.integers(min_value=-(2**31), max_value=2**31 - 1)),
        bad_words_token_ids=[
            common_pb2.TokenSequence(ids=ids)
            for ids in draw(st.lists(st.lists(st.one_of(uint32, st.integers(0, 100))), max_size=3))
        ],
    )
    optional = {
        "max_tokens": small_uint, "temperature": floats, "top_k": st.integers(-(2**31), 2**31 - 1),
        "top_p": floats, "seed": st.integers(-(2**63), 2**63 - 1), "repetition_penalty": floats,
        "logprobs": small_uint,
    }  # fmt: skip
    for name, strategy in optional.items():
        if draw(st.booleans()):
            setattr(message, name, draw(strategy))
    return message


@st.composite
def requests(draw) -> gateway_pb2.GatewayGenerateRequest:
    message = gateway_pb2.GatewayGenerateRequest(
        model=draw(st.sampled_from(["", "tiny", "other", "\x00"])),
        sampling=draw(sampling()),
        stop=draw(st.lists(st.text(max_size=8), max_size=4)),
        bad_words=draw(st.lists(st.text(max_size=8), max_size=3)),
        include_stop_str_in_output=draw(st.booleans()),
        request_id=draw(st.text(max_size=8)),
    )
    kind = draw(st.sampled_from(["text", "token_ids", "chat", "none"]))
    if kind == "text":
        message.text = draw(st.text(max_size=64))
    elif kind == "token_ids":
        message.token_ids.ids.extend(draw(st.lists(uint32, max_size=32)))
    elif kind == "chat":
        roles = st.sampled_from(["user", "system", "assistant", "tool", "", "robot"])
        arguments = st.sampled_from(["", "{}", '{"city": "Oslo"}', "[1]", "null", "{"])
        for _ in range(draw(st.integers(0, 3))):
            turn = message.chat.messages.add(
                role=draw(roles),
                content=draw(st.text(max_size=16)),
                name=draw(st.sampled_from(["", "ann"])),
                tool_call_id=draw(st.sampled_from(["", "call-1"])),
            )
            for _ in range(draw(st.integers(0, 2))):
                turn.tool_calls.add(
                    id="call-1", name=draw(st.sampled_from(["", "f"])), arguments=draw(arguments)
                )
        for _ in range(draw(st.integers(0, 2))):
            message.chat.tools.add(
                name=draw(st.sampled_from(["f", "", "no spaces"])),
                parameters=draw(st.sampled_from(["", "{}", "{", '{"type": "object"}', "[]"])),
            )
        message.chat.tool_choice = draw(st.sampled_from(["", "auto", "none", "required", "f", "g"]))
        if draw(st.booleans()):
            message.chat.add_generation_prompt = draw(st.booleans())
        message.chat.continue_final_message = draw(st.booleans())
        message.chat.chat_template_kwargs = draw(
            st.sampled_from(
                ["", "{}", '{"enable_thinking": false}', '{"tools": []}', "[]", "{", "[" * 10_000]
            )
        )
    return message


@pytest.mark.slow
def test_any_request_gets_ok_or_a_client_error(tiny_llama_dir: Path) -> None:
    served = FakeGateway.start(tiny_llama_dir)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests())
    def check(request) -> None:
        code, details, _ = served.call(request)
        assert code in ALLOWED, (code, request)
        if code is not grpc.StatusCode.OK:
            assert details, code
        else:
            # What the gateway accepted is valid for a node.
            sampling = request.sampling
            if sampling.HasField("temperature"):
                assert math.isfinite(sampling.temperature) and sampling.temperature >= 0

    try:
        check()
        assert served.node.running == 0
    finally:
        served.close()


def test_allowed_token_ids_past_the_vocabulary_or_against_min_tokens_are_invalid(
    tiny_llama_dir: Path,
) -> None:
    served = FakeGateway.start(tiny_llama_dir)
    try:
        vocab = served.gateway.frontend.tokenizer.vocab_size
        request = gateway_pb2.GatewayGenerateRequest(
            text="hi", sampling=common_pb2.SamplingParams(allowed_token_ids=[5, vocab])
        )
        code, details, _ = served.call(request)
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.allowed_token_ids" in details and str(vocab) in details
        request.sampling.allowed_token_ids[:] = [5, vocab - 1]
        assert served.call(request)[0] is grpc.StatusCode.OK
        # Only EOS allowed, yet min_tokens forbids EOS: nothing could be sampled.
        eos = served.gateway.frontend.tokenizer.eos_token_ids[0]
        request.sampling.allowed_token_ids[:] = [eos]
        request.sampling.min_tokens = 1
        code, details, _ = served.call(request)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in details
        assert served.node.running == 0
    finally:
        served.close()


def test_bytes_that_are_no_request_are_invalid_argument(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every RPC the public port serves, with a string field that is not UTF-8 or a corrupt wire
    format: INVALID_ARGUMENT naming the type, and no traceback in the log."""
    served = FakeGateway.start(tiny_llama_dir)
    corrupt = b"\xff\xff\xff"
    calls = [  # (method, kind, payload); a string field: Generate's text (2), Check's service (1)
        ("/pdserve.v1.GatewayService/Generate", "unary_stream", b"\x12\x03\xff\xfe\x41"),
        ("/pdserve.v1.GatewayService/Generate", "unary_stream", corrupt),
        ("/pdserve.v1.GatewayService/ListModels", "unary_unary", corrupt),
        ("/grpc.health.v1.Health/Check", "unary_unary", b"\x0a\x03\xff\xfe\x41"),
        ("/grpc.health.v1.Health/Check", "unary_unary", corrupt),
    ]

    try:
        with caplog.at_level(logging.INFO):
            for method, kind, payload in calls:
                error = served.loop.run_until_complete(
                    refused_raw_call(served.channel, method, kind, payload)
                )
                assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (method, payload, error)
                assert (error.details() or "").startswith("malformed request: Error parsing")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert served.node.running == 0
    finally:
        served.close()
