"""Speculative decoding's bookkeeping: the n-gram proposer, the acceptance rule, the config, and
the scheduler's handling of proposals (pure Python, no model)."""

from __future__ import annotations

import pytest

from services.engine.config import SpeculativeConfig
from services.engine.kv_cache_manager import hash_block_tokens, root_hash
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import SampledToken, ScheduledChunk, Scheduler
from services.engine.speculative import NgramProposer, num_accepted, verify_rows
from services.types import EngineConfigError


def proposer(k: int = 3, high: int = 3, low: int = 1) -> NgramProposer:
    return NgramProposer(
        SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=high, prompt_lookup_min=low)
    )


# ---- the proposer ----


def test_proposes_what_followed_the_latest_match_of_the_suffix() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3]
    # Suffix [2, 3] occurs at 1 (then 4, 5, 9) and at 6 (then 7, 8, 6): the latest wins.
    assert proposer(k=3, high=2).propose("r", tokens, 10) == [7, 8, 6]


def test_prefers_the_longest_suffix_that_matches() -> None:
    tokens = [1, 2, 3, 40, 41, 9, 2, 3, 50, 51, 1, 2, 3]
    # [1, 2, 3] occurs at 0 (then 40, 41); [2, 3] occurs later, at 6 (then 50, 51): the
    # longest suffix decides, not the latest match of any length.
    assert proposer(k=2, high=3).propose("r", tokens, 10) == [40, 41]
    assert proposer(k=2, high=2).propose("r", tokens, 10) == [50, 51]


def test_no_match_of_prompt_lookup_min_proposes_nothing() -> None:
    tokens = [1, 2, 3, 4, 9, 3, 4]
    assert proposer(high=3, low=3).propose("r", tokens, 10) == []  # [9, 3, 4] is new
    assert proposer(high=3, low=2).propose("r", tokens, 10) == [9, 3, 4]


def test_proposals_stop_at_the_limit_and_at_the_end_of_the_tokens() -> None:
    tokens = [4, 5, 6, 7, 4, 5]
    assert proposer(k=5, high=2).propose("r", tokens, 10) == [6, 7, 4, 5]  # to the end
    assert proposer(k=5, high=2).propose("r", tokens, 2) == [6, 7]  # the caller's room
    assert proposer(k=1, high=2).propose("r", tokens, 10) == [6]  # num_speculative_tokens
    assert proposer(k=3, high=2).propose("r", tokens, 0) == []


def test_a_match_across_token_boundaries_is_no_match() -> None:
    # As int32 bytes (little-endian) the first two tokens read 00 01 02 03 04 05 06 07; the
    # last token's bytes, 02 03 04 05, occur there at byte 2, inside no token.
    tokens = [0x03020100, 0x07060504, 9, 0x05040302]
    assert proposer(high=1).propose("r", tokens, 3) == []
    # Aligned, the same bytes are found.
    tokens = [0x03020100, 0x05040302, 9, 11, 0x05040302]
    assert proposer(high=1).propose("r", tokens, 3) == [9, 11, 0x05040302]


def test_a_sequence_shorter_than_the_suffix_proposes_nothing() -> None:
    assert proposer(high=3).propose("r", [7], 3) == []
    assert proposer(high=3).propose("r", [7, 7], 3) == [7]


def test_tokens_are_kept_per_request_and_extended_until_released() -> None:
    p = proposer(k=2, high=2)
    tokens = [1, 2, 3, 1]
    assert p.propose("a", tokens, 5) == [2, 3]
    assert p.propose("b", [8, 9, 8], 5) == [9, 8]
    tokens += [2, 3, 5, 1, 2]  # the outputs that followed: [1, 2] matched latest at 3 now
    assert p.propose("a", tokens, 5) == [3, 5]
    assert len(p) == 2
    p.release("a")
    p.release("a")  # twice is harmless
    assert len(p) == 1
    # A request id reused after its release starts from its new tokens.
    assert p.propose("a", [6, 6], 5) == [6]


def test_the_window_is_one_more_than_the_last_proposal_kept() -> None:
    p = proposer(k=4, high=1)
    cycle = list(range(100, 120))
    tokens = cycle * 2
    assert p.propose("r", tokens, 10) == [100, 101, 102, 103]  # the whole window at first
    tokens += [100, 555]  # one kept, then a sample of its own: the window is 2
    assert p.propose("r", tokens, 10) == []  # 555 occurs nowhere earlier
    tokens += [102]
    assert p.propose("r", tokens, 10) == [103, 104]  # the window of 2 still
    tokens += [103, 104, 105]  # both kept: 3
    assert p.propose("r", tokens, 10) == [106, 107, 108]
    tokens += [777]  # none kept: 1
    assert p.propose("r", tokens, 10) == []
    tokens += [106]
    assert p.propose("r", tokens, 10) == [107]
    tokens += [107, 108]  # each time all are kept: 2, 3, 4, and never more than 4
    assert p.propose("r", tokens, 10) == [109, 110]
    tokens += [109, 110, 111]
    assert p.propose("r", tokens, 10) == [112, 113, 114]
    tokens += [112, 113, 114, 115]
    assert p.propose("r", tokens, 10) == [116, 117, 118, 119]
    tokens += [116, 117, 118, 119, 100]
    assert p.propose("r", tokens, 10) == [555, 102, 103, 104]


# ---- acceptance ----


@pytest.mark.parametrize(
    ("drafts", "sampled", "kept"),
    [
        ((), (5,), 0),
        ((5, 6, 7), (5, 6, 7, 8), 3),
        ((5, 6, 7), (5, 9, 7, 8), 1),
        ((5, 6, 7), (4, 6, 7, 8), 0),
    ],
)
def test_num_accepted_keeps_the_proposals_up_to_the_first_difference(
    drafts: tuple[int, ...], sampled: tuple[int, ...], kept: int
) -> None:
    assert num_accepted(drafts, sampled) == kept


def test_each_verified_position_sees_the_proposals_before_it_as_outputs() -> None:
    assert verify_rows([1, 2], (7, 8)) == [[1, 2], [1, 2, 7], [1, 2, 7, 8]]
    assert verify_rows([], ()) == [[]]


# ---- the config ----


def test_config_from_vllm_json() -> None:
    config = SpeculativeConfig.from_mapping(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (4, 3)
    assert config.prompt_lookup_min == 3  # one bound alone sets both, as vLLM's
    both = SpeculativeConfig.from_mapping({"num_speculative_tokens": 2})
    assert (both.method, both.prompt_lookup_min, both.prompt_lookup_max) == ("ngram", 5, 5)
    low = SpeculativeConfig.from_mapping({"num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (low.prompt_lookup_min, low.prompt_lookup_max) == (2, 2)
    assert low.disable_by_batch_size is None
    guarded = SpeculativeConfig.from_mapping(
        {"num_speculative_tokens": 2, "disable_by_batch_size": 8}
    )
    assert guarded.disable_by_batch_size == 8


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ({}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": "3"}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 3, "method": "eagle"}, "speculative_config.method"),
        ({"num_speculative_tokens": 3, "model": "x"}, "unknown key(s) model"),
        (
            {"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min must be <= prompt_lookup_max",
        ),
        ({"num_speculative_tokens": 3, "prompt_lookup_max": -1}, "prompt_lookup_max"),
        ({"num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ([3], "speculative_config must be an object"),
    ],
)
def test_config_refuses_naming_the_key(value: object, names: str) -> None:
    with pytest.raises(EngineConfigError, match=names.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.from_mapping(value)


# ---- the scheduler ----


def decoding(scheduler: Scheduler, request: Request, drafts: list[int]) -> ScheduledChunk:
    """``request``'s prompt computed (first token 7), then its next chunk with ``drafts``."""
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), {request.request_id: [SampledToken(7)]})
    request.draft_token_ids = drafts
    (chunk,) = scheduler.schedule().chunks
    return chunk


def test_a_decode_with_proposals_computes_them_and_keeps_the_accepted(
    make_scheduler, make_request
) -> None:
    scheduler = make_scheduler(block_size=4)
    request = make_request("r", 6, max_tokens=10)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, {"r": [SampledToken(7)]})
    assert request.num_computed_tokens == 6 and request.num_tokens == 7

    request.draft_token_ids = [8, 9, 10]
    output = scheduler.schedule()
    (chunk,) = output.chunks
    assert (chunk.start_position, chunk.num_tokens, chunk.draft_token_ids) == (6, 4, (8, 9, 10))
    assert chunk.token_ids == [7, 8, 9, 10]
    assert chunk.needs_sample
    assert len(chunk.block_ids) == 3  # slots for positions 6..9

    # Two proposals kept, the third replaced by the sample 11.
    updated = scheduler.update_from_output(output, {"r": [SampledToken(t) for t in (8, 9, 11)]})
    assert updated == [request]
    assert request.output_token_ids == [7, 8, 9, 11]
    assert request.num_computed_tokens == request.num_tokens - 1 == 9
    assert request.draft_token_ids == []
    assert (scheduler.num_draft_tokens_total, scheduler.num_accepted_tokens_total) == (3, 2)

    # The full blocks are indexed by the tokens kept, not by the proposals.
    tokens = request.token_ids
    expected = hash_block_tokens(root_hash(None), tokens[:4])
    expected = hash_block_tokens(expected, tokens[4:8])
    assert request.block_hashes[1] == expected


def test_a_stop_among_the_kept_tokens_ends_the_request_there(make_scheduler, make_request) -> None:
    scheduler = make_scheduler()
    request = make_request("r", 5, max_tokens=10)
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), {"r": [SampledToken(7)]})
    request.draft_token_ids = [8, 2, 9]  # 2 is EOS
    output = scheduler.schedule()
    tokens = [SampledToken(t) for t in (8, 2, 9, 12)]
    scheduler.update_from_output(output, {"r": tokens})
    assert request.output_token_ids == [7, 8, 2]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_proposals_never_pass_max_tokens_the_model_length_or_the_budget(
    make_scheduler, make_request
) -> None:
    chunk = decoding(
        make_scheduler(max_model_len=12), make_request("r", 5, max_tokens=4), [8, 9, 10, 11, 12]
    )
    # 1 output so far, max_tokens 4: two proposals and the sample after them.
    assert chunk.draft_token_ids == (8, 9)
    chunk = decoding(make_scheduler(max_model_len=8), make_request("r", 5), [8, 9, 10, 11])
    assert chunk.draft_token_ids == (8, 9)  # positions 6 and 7 of 8
    chunk = decoding(make_scheduler(max_num_batched_tokens=3), make_request("r", 2), [8, 9, 10, 11])
    assert chunk.draft_token_ids == (8, 9)  # the step's budget of 3 tokens


def test_without_room_for_the_proposals_the_plain_decode_runs(make_scheduler, make_request) -> None:
    # 2 blocks of 4: the request holds both after its first token at position 7 (8 tokens).
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    chunk = decoding(scheduler, make_request("r", 7, max_tokens=10), [8, 9])
    assert (chunk.num_tokens, chunk.draft_token_ids) == (1, ())
    assert scheduler.num_preemptions_total == 0


def test_proposals_wait_for_a_prompt_to_be_computed(make_scheduler, make_request) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("r", 10, max_tokens=10)
    request.draft_token_ids = [8, 9]  # as if left over: a prompt chunk never carries them
    scheduler.add_request(request)
    (chunk,) = scheduler.schedule().chunks
    assert (chunk.num_tokens, chunk.draft_token_ids) == (4, ())


def test_proposals_leave_every_later_running_request_its_token(
    make_scheduler, make_request
) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=6)
    first, second, third = (make_request(r, 2, max_tokens=10) for r in ("a", "b", "c"))
    for request in (first, second, third):
        scheduler.add_request(request)
    output = scheduler.schedule()  # the three prompts: 6 tokens
    scheduler.update_from_output(output, {r: [SampledToken(7)] for r in ("a", "b", "c")})
    first.draft_token_ids = [8, 9, 10, 11]
    chunks = scheduler.schedule().chunks
    # A budget of 6: the first decode and 3 proposals, then one token for each of the others.
    assert [(c.request.request_id, c.num_tokens) for c in chunks] == [("a", 4), ("b", 1), ("c", 1)]
