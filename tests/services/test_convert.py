"""Protobuf ↔ engine conversions: presence semantics, round trips, field-naming errors."""

from __future__ import annotations

import pytest

from pdserve.v1 import common_pb2
from services.convert import (
    PARAM_METADATA_KEY,
    finish_reason_from_proto,
    finish_reason_to_proto,
    load_report_to_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    refusal_metadata,
    refused_param,
    sampling_params_from_proto,
    sampling_params_to_proto,
    stage_timings_from_proto,
    stage_timings_to_proto,
    token_logprob_from_proto,
    token_logprob_to_proto,
    usage_from_proto,
    usage_to_proto,
)
from services.engine import EngineStats, FinishReason, SamplingParams
from services.guided_decoding import GuidedDecoding, GuidedKind
from services.types import SamplingParamError, StageTimings, TokenLogprob, Usage


def test_absent_optional_fields_take_engine_defaults() -> None:
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()


def test_explicit_zero_temperature_is_greedy_not_default() -> None:
    params = sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0))
    assert params.temperature == 0.0 and params.is_greedy


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            max_tokens=7,
            min_tokens=2,
            temperature=0.5,
            top_k=40,
            top_p=0.9,
            min_p=0.05,
            seed=-3,
            repetition_penalty=1.2,
            presence_penalty=-0.5,
            frequency_penalty=0.25,
            stop_token_ids=(3, 9),
            ignore_eos=True,
            logprobs=0,
            priority=-1,
        ),
        SamplingParams(
            guided=GuidedDecoding.json_schema({"type": "object"}), logit_bias=((3, -1.5), (9, 2))
        ),
        SamplingParams(guided=GuidedDecoding.choice(["a", "b"])),
        SamplingParams(allowed_token_ids=(5, 2, 9)),
        SamplingParams(bad_words_token_ids=((7,), (3, 4, 5))),
        SamplingParams(guided=GuidedDecoding(GuidedKind.JSON_OBJECT)),
        SamplingParams(guided=GuidedDecoding(GuidedKind.GRAMMAR, 'start: "x"')),
        SamplingParams(cache_salt="tenant-a"),
        SamplingParams(lora_name="sql-adapter"),
    ],
)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    wire = sampling_params_to_proto(params).SerializeToString()
    assert sampling_params_from_proto(common_pb2.SamplingParams.FromString(wire)) == params


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (common_pb2.SamplingParams(max_tokens=0), r"^sampling\.max_tokens must be >= 1"),
        (common_pb2.SamplingParams(temperature=-1), r"^sampling\.temperature must be >= 0"),
        (common_pb2.SamplingParams(top_p=0.0), r"^sampling\.top_p must be in \(0, 1\]"),
        (common_pb2.SamplingParams(top_k=-5), r"^sampling\.top_k must be >= -1"),
        (common_pb2.SamplingParams(min_p=3), r"^sampling\.min_p must be in \[0, 1\]"),
        (common_pb2.SamplingParams(presence_penalty=9), r"^sampling\.presence_penalty"),
        (
            common_pb2.SamplingParams(max_tokens=2, min_tokens=5),
            r"^sampling\.min_tokens must be <= max_tokens",
        ),
        (common_pb2.SamplingParams(temperature=float("nan")), r"^sampling\.temperature"),
        (
            common_pb2.SamplingParams(guided=common_pb2.GuidedDecoding(kind=4, spec="[1]")),
            r"^sampling\.guided\.choice",
        ),
        (
            common_pb2.SamplingParams(guided=common_pb2.GuidedDecoding(kind=0, spec="x")),
            r"^sampling\.guided\.kind",
        ),
        (common_pb2.SamplingParams(logit_bias={5: 200.0}), r"^sampling\.logit_bias"),
    ],
)
def test_bad_values_name_the_field(message: common_pb2.SamplingParams, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sampling_params_from_proto(message)


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (common_pb2.SamplingParams(top_k=-5), "top_k"),
        (common_pb2.SamplingParams(max_tokens=2, min_tokens=5), "min_tokens"),
        (common_pb2.SamplingParams(frequency_penalty=-3), "frequency_penalty"),
        (common_pb2.SamplingParams(min_p=3), "min_p"),
    ],
)
def test_a_range_error_keeps_its_field_for_the_gateway(
    message: common_pb2.SamplingParams, param: str
) -> None:
    # The gateway turns it into a 400 / INVALID_ARGUMENT whose param is this field.
    with pytest.raises(SamplingParamError) as raised:
        sampling_params_from_proto(message)
    assert raised.value.param == param
    assert str(raised.value).startswith(f"sampling.{param} ")


def test_the_gateways_types_round_trip() -> None:
    logprob = TokenLogprob(7, -0.5, ((7, -0.5), (3, -1.25)))
    wire = token_logprob_to_proto(logprob).SerializeToString()
    assert token_logprob_from_proto(common_pb2.TokenLogprobs.FromString(wire)) == logprob
    usage = Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=4)
    wire = usage_to_proto(usage).SerializeToString()
    assert usage_from_proto(common_pb2.Usage.FromString(wire)) == usage
    timings = StageTimings(prefill_compute_s=0.5, decode_s=1.5, gateway_queue_s=0.25)
    wire = stage_timings_to_proto(timings).SerializeToString()
    assert stage_timings_from_proto(common_pb2.StageTimings.FromString(wire)) == timings


def test_finish_reasons_map_both_ways() -> None:
    for reason in FinishReason:
        assert finish_reason_from_proto(finish_reason_to_proto(reason)) is reason
    assert finish_reason_to_proto(None) == common_pb2.FINISH_REASON_UNSPECIFIED
    assert finish_reason_from_proto(common_pb2.FINISH_REASON_UNSPECIFIED) is None


def test_logprobs_round_trip_and_sort_by_likelihood() -> None:
    entries = {5: -0.1, 8: -2.5, 2: -1.0}
    message = logprobs_to_proto(8, entries)
    assert message.token_id == 8 and message.logprob == pytest.approx(-2.5)
    assert list(message.top_token_ids) == [5, 2, 8]
    decoded = logprobs_from_proto(common_pb2.TokenLogprobs.FromString(message.SerializeToString()))
    assert decoded == pytest.approx(entries)


def test_prompt_tokens_carry_their_rank_and_generated_ones_none() -> None:
    # A prompt token's rank is its place in the whole vocabulary, outside the top-n too.
    messages = prompt_logprobs_to_proto(
        [1, 7, 9], [None, {7: -3.0, 5: -0.5}, {9: -0.1}], [None, 12, 1]
    )
    decoded = [token_logprob_from_proto(m) for m in messages]
    assert [(lp.token_id, lp.rank) for lp in decoded] == [(7, 12), (9, 1)]
    assert decoded[0].top == ((5, -0.5), (7, -3.0))
    # Generated tokens' ranks are not computed: 0 on the wire, None in the gateway's type.
    assert token_logprob_from_proto(logprobs_to_proto(8, {8: -0.5})).rank is None
    ranked = TokenLogprob(7, -3.0, ((5, -0.5), (7, -3.0)), rank=12)
    assert token_logprob_from_proto(token_logprob_to_proto(ranked)) == ranked


def test_load_report_carries_the_routers_inputs() -> None:
    stats = EngineStats(
        num_running=3,
        num_waiting=1,
        num_reserved=2,
        num_held=0,
        num_blocks_used=40,
        num_blocks_total=100,
        prefix_cache_queried_tokens=1000,
        prefix_cache_hit_tokens=250,
        num_preemptions_total=0,
    )
    report = load_report_to_proto(
        stats,
        node_id="d0",
        role="decode",
        fingerprint="abc",
        draining=False,
        lora_names={"sql", "chat"},
    )
    assert (report.num_running, report.num_waiting, report.num_reserved) == (3, 1, 2)
    assert (report.kv_blocks_used, report.kv_blocks_total) == (40, 100)
    assert report.prefix_cache_hit_tokens == 250 and report.kv_layout_fingerprint == "abc"
    assert list(report.lora_names) == ["chat", "sql"]


def test_a_node_refusal_names_its_field_in_trailing_metadata() -> None:
    metadata = refusal_metadata(SamplingParamError("priority", "priority 3 needs ..."))
    assert refused_param(metadata) == "priority"
    assert refusal_metadata(ValueError("prompt_token_ids is empty")) == ()
    assert refused_param(()) is None and refused_param(None) is None
    assert refused_param((("other", "x"), (PARAM_METADATA_KEY, b"bytes"))) is None
