"""A grammar llguidance gives up on after admission, through a running stack.

The gateway's check and the node's compile drive a grammar over its first bytes and token only,
so a grammar can still fail while it runs: when the model takes a branch the check did not, or
further along. The client then gets an error naming the field, never ``stop`` with a text that
does not match: an INVALID_ARGUMENT when no token was sampled yet (the prefill node's first token,
or a colocated node's), a finish reason ``error`` with the message after tokens were, marked as the
request's fault (``invalid_request``).
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import common_pb2
from services.engine.structured_output import StructuredOutputs
from services.models.config import ModelConfig
from support.inprocess_stack import Stack, run_stack

WIDE = "wide: " + " | ".join(json.dumps(f"label{i}") for i in range(2_001))
"""A rule one alternative past llguidance's row limit: fatal once the parser predicts it."""
FAILS_ON_B = f'start: "b" wide | "a"\n{WIDE}'
"""Fine along "a", the branch every probe takes (the lowest byte and token id); fatal on "b"."""
FAILS_AFTER_12 = f"start: /[a-z]{{12}}/ wide\n{WIDE}"
"""Fine for 12 letters, past what the probes look at; fatal after."""


def grammar(spec: str, **fields: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        guided=common_pb2.GuidedDecoding(kind=common_pb2.GUIDED_KIND_GRAMMAR, spec=spec),
        **fields,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_a_grammar_that_fails_while_running_is_an_error_never_a_stop(
    tiny_llama_dir: Path, colocated: bool
) -> None:
    config = ModelConfig.from_model_path(tiny_llama_dir)
    llg = StructuredOutputs(tiny_llama_dir, config.vocab_size, config.eos_token_ids).llg_tokenizer()
    (a_token,), (b_token,) = llg.tokenize_str("a"), llg.tokenize_str("b")
    assert a_token < b_token  # so the node's probe takes "a"

    async def body(stack: Stack) -> None:
        # The first token fails: nothing was sampled yet, so the request itself is refused.
        forced_b = grammar(FAILS_ON_B, max_tokens=8, temperature=0.0, logit_bias={b_token: 100.0})
        with pytest.raises(grpc.aio.AioRpcError) as refusal:
            await stack.generate([5, 6, 7], forced_b)
        assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "guided.grammar" in refusal.value.details()
        assert "max is 2000" in refusal.value.details()

        # A later token fails: the tokens so far went out, then the error.
        tokens, text, finished = await stack.generate(
            [5, 6, 7], grammar(FAILS_AFTER_12, max_tokens=30, temperature=0.0)
        )
        assert finished.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert "guided.grammar" in finished.error and "max is 2000" in finished.error
        assert finished.invalid_request  # the request's fault: the HTTP bridge's 400
        assert tokens and text.isalpha() and text.islower() and len(text) <= 12
        await stack.wait_all_free()

    run_stack(tiny_llama_dir, body, colocated=colocated)
