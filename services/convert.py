"""``pdserve.v1`` protobuf ↔ the shared types (``services.types``), at the gRPC edge only.

The one converter for both sides of the torch line: the nodes' servicers and the gateway (its
node legs and its public gRPC API) import it, so it stays torch-free (an import contract checks).
Every conversion from the wire validates: a bad value raises ``ValueError`` whose message names
the field, which the servicers return as ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from pdserve.v1 import common_pb2
from services.guided_decoding import GuidedDecoding, GuidedKind
from services.types import (
    FinishReason,
    SamplingParamError,
    SamplingParams,
    StageTimings,
    TokenLogprob,
    Usage,
)

PARAM_METADATA_KEY = "pdserve-param"
"""Trailing metadata of a node's INVALID_ARGUMENT: the request field it refused, so that the
gateway's error names it (HTTP ``param``) as the gateway's own checks do."""


def refusal_metadata(error: ValueError) -> tuple[tuple[str, str], ...]:
    """A node's trailing metadata for ``error``: its field, when it names one."""
    if isinstance(error, SamplingParamError):
        return ((PARAM_METADATA_KEY, error.param),)
    return ()


def refused_param(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The field a node's refusal named (``refusal_metadata``), or None."""
    for key, value in metadata or ():
        if key == PARAM_METADATA_KEY and isinstance(value, str):
            return value
    return None


_FINISH_TO_PROTO: dict[FinishReason, common_pb2.FinishReason] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in _FINISH_TO_PROTO.items()}
_GUIDED_TO_PROTO: dict[GuidedKind, common_pb2.GuidedKind] = {
    GuidedKind.JSON_OBJECT: common_pb2.GUIDED_KIND_JSON_OBJECT,
    GuidedKind.JSON_SCHEMA: common_pb2.GUIDED_KIND_JSON_SCHEMA,
    GuidedKind.REGEX: common_pb2.GUIDED_KIND_REGEX,
    GuidedKind.CHOICE: common_pb2.GUIDED_KIND_CHOICE,
    GuidedKind.GRAMMAR: common_pb2.GUIDED_KIND_GRAMMAR,
}
_GUIDED_FROM_PROTO: dict[common_pb2.GuidedKind, GuidedKind] = {
    v: k for k, v in _GUIDED_TO_PROTO.items()
}

# proto3 `optional` fields: absent means the engine's default, so only present ones are passed.
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "cache_salt",
    "lora_name",
)


def sampling_params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ``ValueError`` naming the field (prefixed ``sampling.``) when a value is bad: a
    ``SamplingParamError`` (``param`` without the prefix) for a range, plain for ``guided.kind``."""
    kwargs: dict[str, object] = {
        name: getattr(message, name) for name in _OPTIONAL_FIELDS if message.HasField(name)
    }
    kwargs.update(
        min_tokens=message.min_tokens,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        priority=message.priority,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        allowed_token_ids=tuple(message.allowed_token_ids),
        bad_words_token_ids=tuple(tuple(word.ids) for word in message.bad_words_token_ids),
    )
    try:
        if message.HasField("guided"):
            kwargs["guided"] = guided_from_proto(message.guided)
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except SamplingParamError as exc:
        raise SamplingParamError(exc.param, f"sampling.{exc}") from None
    except ValueError as exc:
        raise ValueError(f"sampling.{exc}") from None


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    if params.stop:
        # A node works on token ids; dropping the strings here would let a request run on past
        # where its caller asked it to end.
        raise SamplingParamError(
            "stop",
            "stop strings are applied to text, which a node never sees: the gateway takes them "
            "as its own field (its text stream ends the request)",
        )
    if params.n != 1:
        raise SamplingParamError(
            "n", "a node generates one sample a request: fan n out as requests of their own"
        )
    # Text and prompt options the offline LLM applies before the engine: a node would drop them.
    if params.bad_words:
        raise SamplingParamError(
            "bad_words", "a node takes bad words as token ids: give bad_words_token_ids"
        )
    if params.truncate_prompt_tokens is not None:
        raise SamplingParamError(
            "truncate_prompt_tokens",
            "a node runs the prompt it is given: truncate the prompt before sending it",
        )
    message = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        priority=params.priority,
        allowed_token_ids=list(params.allowed_token_ids),
        bad_words_token_ids=[
            common_pb2.TokenSequence(ids=word) for word in params.bad_words_token_ids
        ],
    )
    message.logit_bias.update(dict(params.logit_bias))
    if params.guided is not None:
        message.guided.CopyFrom(guided_to_proto(params.guided))
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        message.prompt_logprobs = params.prompt_logprobs
    if params.cache_salt is not None:
        message.cache_salt = params.cache_salt
    if params.lora_name is not None:
        message.lora_name = params.lora_name
    return message


def guided_from_proto(message: common_pb2.GuidedDecoding) -> GuidedDecoding:
    kind = _GUIDED_FROM_PROTO.get(message.kind)
    if kind is None:
        raise ValueError(f"guided.kind {message.kind} is not a known kind")
    return GuidedDecoding(kind, message.spec)


def guided_to_proto(guided: GuidedDecoding) -> common_pb2.GuidedDecoding:
    return common_pb2.GuidedDecoding(kind=_GUIDED_TO_PROTO[guided.kind], spec=guided.spec)


def prompt_from_proto(token_ids: Sequence[int]) -> list[int]:
    """Token ids as plain ints; emptiness and vocabulary bounds are the engine's checks."""
    return list(token_ids)


def finish_reason_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason:
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    return _FINISH_FROM_PROTO.get(value)


def logprobs_to_proto(
    token_id: int, logprobs: dict[int, float], rank: int | None = None
) -> common_pb2.TokenLogprobs:
    """``logprobs`` holds the sampled token and its top-n alternatives (engine convention);
    ``rank``: the token's in the vocabulary, where computed."""
    top = sorted(logprobs.items(), key=lambda item: item[1], reverse=True)
    return common_pb2.TokenLogprobs(
        token_id=token_id,
        logprob=logprobs[token_id],
        top_token_ids=[t for t, _ in top],
        top_logprobs=[lp for _, lp in top],
        rank=rank or 0,
    )


def prompt_logprobs_to_proto(
    prompt_token_ids: Sequence[int],
    entries: Sequence[dict[int, float] | None],
    ranks: Sequence[int | None],
) -> list[common_pb2.TokenLogprobs]:
    """The engine's prompt logprobs and their tokens' ranks (entry 0 None) as prompt tokens
    1, 2, ...'s messages."""
    return [
        logprobs_to_proto(token_id, entry, rank)
        for token_id, entry, rank in zip(prompt_token_ids[1:], entries[1:], ranks[1:], strict=True)
        if entry is not None
    ]


def logprobs_from_proto(message: common_pb2.TokenLogprobs) -> dict[int, float]:
    entries = dict(zip(message.top_token_ids, message.top_logprobs, strict=True))
    entries[message.token_id] = message.logprob
    return entries


def token_logprob_from_proto(message: common_pb2.TokenLogprobs) -> TokenLogprob:
    """The gateway's view: the sampled token apart from its alternatives, best first."""
    return TokenLogprob(
        token_id=message.token_id,
        logprob=message.logprob,
        top=tuple(zip(message.top_token_ids, message.top_logprobs, strict=True)),
        rank=message.rank or None,  # 0: not computed (ranks start at 1)
    )


def token_logprob_to_proto(logprob: TokenLogprob) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=logprob.token_id,
        logprob=logprob.logprob,
        top_token_ids=[token_id for token_id, _ in logprob.top],
        top_logprobs=[value for _, value in logprob.top],
        rank=logprob.rank or 0,
    )


def usage_from_proto(message: common_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=message.prompt_tokens,
        completion_tokens=message.completion_tokens,
        cached_prompt_tokens=message.cached_prompt_tokens,
    )


def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
    )


def stage_timings_to_proto(timings: StageTimings) -> common_pb2.StageTimings:
    return common_pb2.StageTimings(**dataclasses.asdict(timings))


def stage_timings_from_proto(message: common_pb2.StageTimings) -> StageTimings:
    """Raises ``ValueError`` naming the field when a duration is negative or not finite."""
    values = {f.name: getattr(message, f.name) for f in dataclasses.fields(StageTimings)}
    for name, value in values.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"timings.{name} must be a finite duration >= 0, got {value}")
    return StageTimings(**values)


class LoadStats(Protocol):
    """What a load report carries of ``services.engine.EngineStats`` (torch-free here)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_reserved(self) -> int: ...
    @property
    def num_blocks_used(self) -> int: ...
    @property
    def num_blocks_total(self) -> int: ...
    @property
    def prefix_cache_queried_tokens(self) -> int: ...
    @property
    def prefix_cache_hit_tokens(self) -> int: ...


def load_report_to_proto(
    stats: LoadStats,
    *,
    node_id: str,
    role: str,
    fingerprint: str,
    draining: bool,
    lora_names: Collection[str] = (),
) -> common_pb2.LoadReport:
    return common_pb2.LoadReport(
        node_id=node_id,
        role=role,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_reserved=stats.num_reserved,
        kv_blocks_used=stats.num_blocks_used,
        kv_blocks_total=stats.num_blocks_total,
        prefix_cache_queried_tokens=stats.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=stats.prefix_cache_hit_tokens,
        kv_layout_fingerprint=fingerprint,
        draining=draining,
        lora_names=sorted(lora_names),
    )
