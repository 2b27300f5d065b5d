"""Gateway dataclasses ↔ ``pdserve.v1`` protobuf, for the node legs and the public gRPC API."""

from __future__ import annotations

from gateway.errors import invalid
from gateway.generation import FinishReason, StageTimings, TokenLogprob, Usage
from gateway.sampling import SamplingOptions
from pdserve.v1 import common_pb2
from services.guided_decoding import GuidedDecoding, GuidedKind

_FINISH_FROM_PROTO = {
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
    common_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}
_FINISH_TO_PROTO = {value: key for key, value in _FINISH_FROM_PROTO.items()}
_STAGES = tuple(StageTimings.__dataclass_fields__)


def sampling_to_proto(options: SamplingOptions) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        max_tokens=options.max_tokens,
        min_tokens=options.min_tokens,
        min_p=options.min_p,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        stop_token_ids=options.stop_token_ids,
        ignore_eos=options.ignore_eos,
        priority=options.priority,
        logit_bias=dict(options.logit_bias),
    )
    if options.guided is not None:
        message.guided.CopyFrom(guided_to_proto(options.guided))
    # proto3 optional fields: left absent to mean "the node's default".
    for name in ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "logprobs"):
        value = getattr(options, name)
        if value is not None:
            setattr(message, name, value)
    return message


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingOptions:
    """Raises ``GatewayError`` (INVALID_ARGUMENT) naming the field when a value is bad."""
    optional = {
        name: getattr(message, name) if message.HasField(name) else None
        for name in ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "logprobs")
    }
    guided = None
    if message.HasField("guided"):
        try:
            guided = guided_from_proto(message.guided)
            guided.check()
        except ValueError as exc:
            raise invalid(str(exc), param="sampling.guided") from None
    return SamplingOptions(
        guided=guided,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        max_tokens=message.max_tokens if message.HasField("max_tokens") else 16,
        min_tokens=message.min_tokens,
        min_p=message.min_p,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        priority=message.priority,
        **optional,
    )


def guided_to_proto(guided: GuidedDecoding) -> common_pb2.GuidedDecoding:
    kind = common_pb2.GuidedKind.Value(f"GUIDED_KIND_{guided.kind.name}")
    return common_pb2.GuidedDecoding(kind=kind, spec=guided.spec)


def guided_from_proto(message: common_pb2.GuidedDecoding) -> GuidedDecoding:
    """Raises ``ValueError`` naming the field for an unknown kind or a malformed spec."""
    name = common_pb2.GuidedKind.Name(message.kind).removeprefix("GUIDED_KIND_")
    if name not in GuidedKind.__members__:
        raise ValueError(f"guided.kind {message.kind} is not a known kind")
    return GuidedDecoding(GuidedKind[name], message.spec)


def logprob_from_proto(message: common_pb2.TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(
        token_id=message.token_id,
        logprob=message.logprob,
        top=tuple(zip(message.top_token_ids, message.top_logprobs, strict=True)),
    )


def logprob_to_proto(logprob: TokenLogprob) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=logprob.token_id,
        logprob=logprob.logprob,
        top_token_ids=[token_id for token_id, _ in logprob.top],
        top_logprobs=[value for _, value in logprob.top],
    )


def finish_reason_from_proto(value: int) -> FinishReason:
    return _FINISH_FROM_PROTO.get(value, FinishReason.ERROR)


def finish_reason_to_proto(reason: FinishReason) -> int:
    return _FINISH_TO_PROTO[reason]


def timings_from_proto(message: common_pb2.StageTimings) -> StageTimings:
    return StageTimings(**{name: getattr(message, name) for name in _STAGES})


def timings_to_proto(timings: StageTimings) -> common_pb2.StageTimings:
    return common_pb2.StageTimings(**{name: getattr(timings, name) for name in _STAGES})


def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
    )
