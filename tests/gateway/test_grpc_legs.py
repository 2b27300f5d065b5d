"""What the gRPC legs make of a node's replies (no channel needed: the converters at the edge)."""

from __future__ import annotations

import logging

import pytest

from gateway.routing import grpc_legs
from gateway.routing.node import Node
from pdserve.v1 import common_pb2, decode_pb2
from services.types import FinishReason, Role, StageTimings


def test_a_nodes_bad_timings_are_dropped_and_its_tokens_stand(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = Node("127.0.0.1:1", Role.DECODE)
    message = decode_pb2.Finished(
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2),
        timings=common_pb2.StageTimings(decode_s=float("nan")),
    )
    with caplog.at_level(logging.WARNING, logger=grpc_legs.__name__):
        finished = grpc_legs._finished_from_proto(message, node)
    assert finished.finish_reason is FinishReason.LENGTH
    assert finished.usage.completion_tokens == 2
    assert finished.timings == StageTimings()
    assert "bad stage timings" in caplog.text and "timings.decode_s" in caplog.text


def test_an_unknown_finish_reason_reads_as_an_error() -> None:
    node = Node("127.0.0.1:1", Role.DECODE)
    message = decode_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_UNSPECIFIED)
    assert grpc_legs._finished_from_proto(message, node).finish_reason is FinishReason.ERROR
