"""Scheduler: continuous batching, chunked prefill, preemption, policies, aborts and stops.

Every test drives the scheduler with ``run_step`` (schedule, fake sampling, update) and ends with
all requests drained and every KV block free.
"""

from __future__ import annotations

import pytest

from services.engine import LLM, default_max_num_batched_tokens
from services.engine.request import RequestStatus
from services.engine.scheduler import SampledToken, ScheduledChunk, SchedulerOutput
from services.types import FinishReason


def chunk_of(output: SchedulerOutput, request_id: str) -> ScheduledChunk:
    [chunk] = [c for c in output.chunks if c.request.request_id == request_id]
    return chunk


# --- continuous batching ---------------------------------------------------------------------


def test_first_step_prefills_every_waiting_request(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler()
    for i, num_tokens in enumerate((5, 3, 9)):
        scheduler.add_request(make_request(f"r{i}", num_tokens, max_tokens=2))

    step = run_step(scheduler)

    assert step.chunk_sizes == {"r0": 5, "r1": 3, "r2": 9}
    assert [c.start_position for c in step.output.chunks] == [0, 0, 0]
    assert all(c.needs_sample for c in step.output.chunks)
    assert step.sampled_ids == ["r0", "r1", "r2"]
    assert step.output.num_batched_tokens == 17
    assert [r.request_id for r in step.updated] == ["r0", "r1", "r2"]
    assert all(r.status is RequestStatus.RUNNING for r in step.updated)
    assert all(r.num_output_tokens == 1 for r in step.updated)
    assert scheduler.num_running == 3 and scheduler.num_waiting == 0
    drain(scheduler)
    assert_all_free(scheduler.kv_cache)


def test_request_added_during_decodes_joins_the_next_step(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=10))
    scheduler.add_request(make_request("b", 6, max_tokens=10))
    run_step(scheduler)
    run_step(scheduler)

    scheduler.add_request(make_request("late", 5, max_tokens=2))
    step = run_step(scheduler)

    # Decodes of the running requests, then the newcomer's whole prompt, in one step.
    assert step.chunk_sizes == {"a": 1, "b": 1, "late": 5}
    assert chunk_of(step.output, "a").start_position == 5
    assert chunk_of(step.output, "late").start_position == 0
    assert scheduler.requests["late"].num_output_tokens == 1
    drain(scheduler)
    assert_all_free(scheduler.kv_cache)


def test_finished_request_leaves_and_frees_its_blocks_at_once(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    short = make_request("short", 8, max_tokens=2)
    long = make_request("long", 8, max_tokens=10)
    scheduler.add_request(short)
    scheduler.add_request(long)
    run_step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 16 - 4

    step = run_step(scheduler)

    assert short in step.updated
    assert short.status is RequestStatus.FINISHED_LENGTH
    assert short.finish_reason is FinishReason.LENGTH
    assert short.output_token_ids == [7, 7]
    assert scheduler.kv_cache.block_ids("short") == []
    assert "short" not in scheduler.requests
    assert scheduler.running == [long]
    assert scheduler.kv_cache.num_free_blocks == 16 - 3
    assert run_step(scheduler).chunk_sizes == {"long": 1}
    drain(scheduler)
    assert long.num_output_tokens == 10
    assert_all_free(scheduler.kv_cache)


def test_max_num_seqs_caps_the_running_batch(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=2))

    assert run_step(scheduler).chunk_sizes == {"r0": 3, "r1": 3}
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2

    # r0 and r1 finish in this step; their places go to r2 and r3 only in the next one.
    assert run_step(scheduler).chunk_sizes == {"r0": 1, "r1": 1}
    assert run_step(scheduler).chunk_sizes == {"r2": 3, "r3": 3}

    outputs = drain(scheduler)
    assert all(len(o.chunks) <= 2 for o in outputs)
    assert_all_free(scheduler.kv_cache)


def test_token_budget_chunks_a_long_prompt_beside_decodes(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(num_blocks=32, max_num_batched_tokens=8)
    decoder = make_request("decoder", 3, max_tokens=20)
    scheduler.add_request(decoder)
    run_step(scheduler)
    long = make_request("long", 20, max_tokens=2)
    scheduler.add_request(long)

    steps = [run_step(scheduler) for _ in range(3)]

    for step in steps:
        assert step.output.num_batched_tokens <= 8
        assert step.chunk_sizes["decoder"] == 1
        assert "decoder" in step.sampled_ids
    long_chunks = [chunk_of(step.output, "long") for step in steps]
    assert [c.num_tokens for c in long_chunks] == [7, 7, 6]
    assert [c.start_position for c in long_chunks] == [0, 7, 14]
    assert [c.token_ids for c in long_chunks] == [
        long.prompt_token_ids[0:7],
        long.prompt_token_ids[7:14],
        long.prompt_token_ids[14:20],
    ]
    # Only the chunk that reaches the last prompt token is sampled.
    assert [c.needs_sample for c in long_chunks] == [False, False, True]
    assert ["long" in step.sampled_ids for step in steps] == [False, False, True]
    assert long.num_output_tokens == 1
    assert long.num_computed_tokens == 20
    assert decoder.num_output_tokens == 4
    drain(scheduler)
    assert_all_free(scheduler.kv_cache)


def test_token_budget_caps_admissions(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, 6, max_tokens=1))

    step = run_step(scheduler)

    # b gets what is left of the budget; c waits.
    assert step.chunk_sizes == {"a": 6, "b": 4}
    assert step.sampled_ids == ["a"]
    assert [r.request_id for r in step.updated] == ["a"]
    assert scheduler.num_waiting == 1
    step = run_step(scheduler)
    assert step.chunk_sizes == {"b": 2, "c": 6}
    assert step.sampled_ids == ["b", "c"]
    drain(scheduler)
    assert_all_free(scheduler.kv_cache)


# --- preemption ------------------------------------------------------------------------------


def test_out_of_blocks_preempts_the_latest_request_which_resumes_from_the_prefix_cache(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    # 4 blocks of 4 tokens: two 6-token prompts fill them after 2 decodes each.
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    first = make_request("first", 6, max_tokens=4)
    latest = make_request("latest", 6, max_tokens=4)
    scheduler.add_request(first)
    scheduler.add_request(latest)
    for _ in range(3):
        assert run_step(scheduler).output.preempted_request_ids == []
    assert scheduler.kv_cache.num_free_blocks == 0
    waiting = make_request("waiting", 2, max_tokens=1)
    scheduler.add_request(waiting)

    # first's 9th token needs a third block: the latest request gives its blocks back.
    step = run_step(scheduler)

    assert step.output.preempted_request_ids == ["latest"]
    assert step.chunk_sizes == {"first": 1}  # nobody is admitted in a preempting step
    assert latest.status is RequestStatus.PREEMPTED
    assert latest.num_computed_tokens == 0
    assert latest.num_preemptions == 1
    assert scheduler.num_preemptions_total == 1
    assert latest.output_token_ids == [7, 7, 7]
    assert scheduler.kv_cache.block_ids("latest") == []
    assert list(scheduler.waiting) == [latest, waiting]
    assert first.status is RequestStatus.FINISHED_LENGTH

    # Resumed: its prompt and outputs so far are recomputed, the first block from the cache.
    step = run_step(scheduler)
    resumed = chunk_of(step.output, "latest")
    assert resumed.start_position == 4
    assert resumed.num_tokens == 9 - 4
    assert resumed.needs_sample
    drain(scheduler)
    assert latest.status is RequestStatus.FINISHED_LENGTH
    assert latest.output_token_ids == [7, 7, 7, 7]
    assert waiting.status is RequestStatus.FINISHED_LENGTH
    assert_all_free(scheduler.kv_cache)


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "urgent"), ("priority", "patient")])
def test_preemption_victim_follows_the_policy(
    make_scheduler, make_request, run_step, drain, assert_all_free, policy: str, victim: str
) -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, policy=policy)
    patient = make_request("patient", 6, max_tokens=6, priority=5)
    scheduler.add_request(patient)
    run_step(scheduler)
    urgent = make_request("urgent", 6, max_tokens=6, priority=0)
    scheduler.add_request(urgent)  # arrives later, but more urgent
    preempted: list[str] = []
    for _ in range(3):
        preempted += run_step(scheduler).output.preempted_request_ids

    # FCFS preempts the latest arrival, the priority policy the highest priority value.
    assert preempted == [victim]
    assert scheduler.requests[victim].status is RequestStatus.PREEMPTED
    assert scheduler.requests[victim].num_computed_tokens == 0
    drain(scheduler)
    assert patient.num_output_tokens == urgent.num_output_tokens == 6
    assert_all_free(scheduler.kv_cache)


def test_priority_policy_admits_lower_values_first(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    for name, priority in (("low", 9), ("mid", 5), ("high", -1)):
        scheduler.add_request(make_request(name, 3, max_tokens=1, priority=priority))

    order = [chunk.request.request_id for output in drain(scheduler) for chunk in output.chunks]

    assert order == ["high", "mid", "low"]
    assert_all_free(scheduler.kv_cache)


def test_priority_ties_are_served_in_arrival_order(
    make_scheduler, make_request, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    for name, arrival in (("second", 2.0), ("third", 3.0), ("first", 1.0)):
        scheduler.add_request(make_request(name, 3, max_tokens=1, priority=1, arrival_time=arrival))

    order = [chunk.request.request_id for output in drain(scheduler) for chunk in output.chunks]

    assert order == ["first", "second", "third"]
    assert_all_free(scheduler.kv_cache)


def test_fcfs_ignores_priority(make_scheduler, make_request, drain, assert_all_free) -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="fcfs")
    for name, priority in (("a", 9), ("b", -1)):
        scheduler.add_request(make_request(name, 3, max_tokens=1, priority=priority))

    order = [chunk.request.request_id for output in drain(scheduler) for chunk in output.chunks]

    assert order == ["a", "b"]
    assert_all_free(scheduler.kv_cache)


# --- prefix cache through the scheduler ------------------------------------------------------


def test_admission_starts_from_the_prefix_cache(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(block_size=4)
    prompt = list(range(100, 110))
    scheduler.add_request(make_request("first", token_ids=prompt, max_tokens=1))
    drain(scheduler)

    again = make_request("again", token_ids=prompt, max_tokens=1)
    scheduler.add_request(again)
    step = run_step(scheduler)

    chunk = chunk_of(step.output, "again")
    assert (chunk.start_position, chunk.num_tokens) == (8, 2)
    assert again.num_cached_tokens == 8
    assert scheduler.kv_cache.prefix_cache_stats.num_hit_tokens == 8
    assert_all_free(scheduler.kv_cache)


def test_identical_prompts_in_one_step_compute_side_by_side(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(block_size=4)
    prompt = list(range(100, 110))
    twins = [make_request(name, token_ids=prompt, max_tokens=3) for name in ("a", "b")]
    for request in twins:
        scheduler.add_request(request)

    step = run_step(scheduler)

    # Neither was cached when both were admitted: each computes its own copy.
    assert step.chunk_sizes == {"a": 10, "b": 10}
    assert not set(scheduler.kv_cache.block_ids("a")) & set(scheduler.kv_cache.block_ids("b"))
    drain(scheduler)
    assert [r.output_token_ids for r in twins] == [[7, 7, 7]] * 2
    later = make_request("later", token_ids=prompt, max_tokens=1)
    scheduler.add_request(later)
    run_step(scheduler)
    assert later.num_cached_tokens == 8
    assert_all_free(scheduler.kv_cache)


def test_prefix_stats_count_a_request_that_waits_for_blocks_once(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add_request(make_request("big", 12, max_tokens=4))
    run_step(scheduler)
    scheduler.add_request(make_request("blocked", 8, max_tokens=1))  # needs 2 blocks, 1 is free

    drain(scheduler)

    assert scheduler.kv_cache.prefix_cache_stats.num_queried_tokens == 12 + 8
    assert_all_free(scheduler.kv_cache)


# --- aborts ----------------------------------------------------------------------------------


def test_abort_a_waiting_request(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    running = make_request("running", 4, max_tokens=3)
    waiting = make_request("waiting", 4, max_tokens=3)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler)

    assert scheduler.abort_request("waiting") is waiting

    assert waiting.status is RequestStatus.FINISHED_ABORTED
    assert waiting.finish_reason is FinishReason.ABORT
    assert scheduler.num_waiting == 0
    assert "waiting" not in scheduler.requests
    outputs = drain(scheduler)
    assert all(chunk.request is not waiting for o in outputs for chunk in o.chunks)
    assert running.num_output_tokens == 3
    assert_all_free(scheduler.kv_cache)


def test_abort_a_running_request_frees_its_blocks_at_once(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(num_blocks=16)
    doomed = make_request("doomed", 9, max_tokens=10)
    other = make_request("other", 4, max_tokens=3)
    scheduler.add_request(doomed)
    scheduler.add_request(other)
    run_step(scheduler)
    assert len(scheduler.kv_cache.block_ids("doomed")) == 3

    scheduler.abort_request("doomed")

    assert doomed.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.block_ids("doomed") == []
    assert scheduler.kv_cache.num_free_blocks == 16 - 1
    assert scheduler.running == [other]
    assert run_step(scheduler).chunk_sizes == {"other": 1}
    drain(scheduler)
    assert doomed.num_output_tokens == 1
    assert_all_free(scheduler.kv_cache)


def test_abort_in_the_middle_of_a_chunked_prefill(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    long = make_request("long", 30, max_tokens=2)
    scheduler.add_request(long)
    run_step(scheduler)
    run_step(scheduler)
    assert long.num_computed_tokens == 16
    assert long.num_output_tokens == 0

    scheduler.abort_request("long")

    assert long.status is RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished_requests
    assert scheduler.schedule().is_empty
    assert_all_free(scheduler.kv_cache)


def test_abort_a_preempted_request(
    make_scheduler, make_request, run_step, drain, assert_all_free
) -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add_request(make_request("first", 6, max_tokens=6))
    latest = make_request("latest", 6, max_tokens=6)
    scheduler.add_request(latest)
    for _ in range(4):
        run_step(scheduler)
    assert latest.status is RequestStatus.PREEMPTED

    scheduler.abort_request("latest")

    assert latest.status is RequestStatus.FINISHED_ABORTED
    assert latest not in scheduler.waiting
    drain(scheduler)
    assert_all_free(scheduler.kv_cache)


def test_abort_unknown_request_returns_none(make_scheduler) -> None:
    assert make_scheduler().abort_request("nope") is None


def test_abort_between_schedule_and_update_is_skipped(
    make_scheduler, make_request, drain, assert_all_free
) -> None:
    scheduler = make_scheduler()
    doomed = make_request("doomed", 5, max_tokens=4)
    other = make_request("other", 5, max_tokens=4)
    scheduler.add_request(doomed)
    scheduler.add_request(other)

    output = scheduler.schedule()
    scheduler.abort_request("doomed")
    sampled = {c.request.request_id: [SampledToken(7)] for c in output.chunks}
    updated = scheduler.update_from_output(output, sampled)

    assert updated == [other]
    assert doomed.output_token_ids == []
    assert doomed.num_computed_tokens == 0
    assert doomed.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.block_ids("doomed") == []
    drain(scheduler)
    assert other.num_output_tokens == 4
    assert_all_free(scheduler.kv_cache)


# --- stop conditions -------------------------------------------------------------------------


def run_alone(make_scheduler, make_request, drain, sampled_token, max_model_len=256, **params):
    scheduler = make_scheduler(max_model_len=max_model_len)
    request = make_request("r", params.pop("num_tokens", 4), **params)
    scheduler.add_request(request)
    drain(scheduler, sampled_token)
    return scheduler, request


def test_eos_stops(make_scheduler, make_request, drain, assert_all_free) -> None:
    eos = 2
    scheduler, request = run_alone(make_scheduler, make_request, drain, eos, max_tokens=10)
    assert request.output_token_ids == [eos]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.finish_reason is FinishReason.STOP
    assert_all_free(scheduler.kv_cache)


def test_ignore_eos_runs_to_max_tokens(
    make_scheduler, make_request, drain, assert_all_free
) -> None:
    scheduler, request = run_alone(
        make_scheduler, make_request, drain, 2, max_tokens=5, ignore_eos=True
    )
    assert request.output_token_ids == [2] * 5
    assert request.finish_reason is FinishReason.LENGTH
    assert_all_free(scheduler.kv_cache)


def test_stop_token_ids_stop_even_with_ignore_eos(
    make_scheduler, make_request, drain, assert_all_free
) -> None:
    tokens = iter([11, 12, 13, 14])
    scheduler, request = run_alone(
        make_scheduler,
        make_request,
        drain,
        lambda _: next(tokens),
        max_tokens=10,
        stop_token_ids=[13],
        ignore_eos=True,
    )
    assert request.output_token_ids == [11, 12, 13]
    assert request.finish_reason is FinishReason.STOP
    assert_all_free(scheduler.kv_cache)


def test_non_eos_tokens_do_not_stop(make_scheduler, make_request, drain, assert_all_free) -> None:
    scheduler, request = run_alone(make_scheduler, make_request, drain, 3, max_tokens=4)
    assert request.output_token_ids == [3, 3, 3, 3]
    assert request.finish_reason is FinishReason.LENGTH
    assert_all_free(scheduler.kv_cache)


@pytest.mark.parametrize("stop_kind", ["eos", "stop_token_ids"])
def test_min_tokens_suppresses_stops(
    make_scheduler, make_request, drain, assert_all_free, stop_kind: str
) -> None:
    stop_id = 2 if stop_kind == "eos" else 40
    extra = {"stop_token_ids": [40]} if stop_kind == "stop_token_ids" else {}
    scheduler, request = run_alone(
        make_scheduler, make_request, drain, stop_id, max_tokens=10, min_tokens=3, **extra
    )
    assert request.output_token_ids == [stop_id] * 3
    assert request.finish_reason is FinishReason.STOP
    assert_all_free(scheduler.kv_cache)


def test_max_tokens_finishes_with_length(
    make_scheduler, make_request, drain, assert_all_free
) -> None:
    scheduler, request = run_alone(make_scheduler, make_request, drain, 7, max_tokens=3)
    assert request.num_output_tokens == 3
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert_all_free(scheduler.kv_cache)


def test_max_model_len_finishes_with_length(
    make_scheduler, make_request, drain, assert_all_free
) -> None:
    scheduler, request = run_alone(
        make_scheduler, make_request, drain, 7, max_model_len=10, num_tokens=8, max_tokens=16
    )
    assert request.num_output_tokens == 2
    assert request.num_tokens == 10
    assert request.finish_reason is FinishReason.LENGTH
    assert_all_free(scheduler.kv_cache)


def test_scheduler_without_requests_schedules_nothing(make_scheduler) -> None:
    scheduler = make_scheduler()
    output = scheduler.schedule()
    assert output.is_empty
    assert output.num_batched_tokens == 0
    assert scheduler.update_from_output(output, {}) == []


# --- the step budget's default -----------------------------------------------------------------


def test_step_budget_defaults_per_device_and_use(tiny_llama_dir) -> None:
    # A CPU's GEMMs peak at 2,048 tokens a step; a GPU's host launches want larger steps, the
    # offline LLM (no decode waiting on a prefill step) larger still.
    assert default_max_num_batched_tokens("cpu", offline=True) == 2048
    assert default_max_num_batched_tokens("cpu", offline=False) == 2048
    assert default_max_num_batched_tokens("cuda", offline=False) == 8192
    assert default_max_num_batched_tokens("cuda:1", offline=True) == 16384
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=1 << 22, max_model_len=64)
    assert llm.engine.config.scheduler.max_num_batched_tokens == 2048
    llm = LLM(
        tiny_llama_dir, dtype="float32", kv_cache_memory=1 << 22, max_model_len=64,
        max_num_batched_tokens=24,
    )  # fmt: skip
    assert llm.engine.config.scheduler.max_num_batched_tokens == 24
