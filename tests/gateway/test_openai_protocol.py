"""The OpenAI protocol's closed vocabularies agree with the engine's."""

from __future__ import annotations

from typing import get_args

from gateway.http_api.openai_protocol import FinishReasonName
from services.types import FinishReason


def test_every_finish_reason_is_an_openai_finish_reason_name() -> None:
    # The HTTP bridge casts FinishReason values to FinishReasonName: a reason added to the
    # engine without a name here would send a value the response model does not allow.
    names = set(get_args(FinishReasonName))
    assert {reason.value for reason in FinishReason} | {"tool_calls"} == names
