"""The engine-side handoff of disaggregated serving, in one process without a transport.

A prefill engine computes each prompt with ``hold_kv``; its pages are copied byte for byte (as a
transport would, using ``layer_copies``) into blocks a decode engine reserved; the decode engine
commits with the prefill's first token and decodes on. The tokens must be exactly what one
engine produces alone, and both engines must end with every block free.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine import LLM, EngineCore, SamplingParams
from services.engine.kv_layout import KvLayout, layer_copies

NUM_TOKENS = 12


def make_engine(model_dir: Path, kv_cache_memory: int, **kwargs: Any) -> EngineCore:
    # Different cache sizes on the two sides: the value half of each layer sits at a different
    # offset, which layer_copies must account for.
    return LLM(
        model_dir,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory=kv_cache_memory,
        max_num_batched_tokens=64,  # chunked prefill on the prefill side
        **kwargs,
    ).engine


def copy_pages(src: EngineCore, src_ids: list[int], dst: EngineCore, dst_ids: list[int]) -> None:
    # One flat byte view per layer region, as registered memory would be.
    src_bytes = [cache.view(-1).view(torch.uint8) for cache in src.kv_caches]
    dst_bytes = [cache.view(-1).view(torch.uint8) for cache in dst.kv_caches]
    for copy in layer_copies(src.kv_layout, src_ids, dst.kv_layout, dst_ids):
        source = src_bytes[copy.layer][copy.src_offset : copy.src_offset + copy.length]
        dst_bytes[copy.layer][copy.dst_offset : copy.dst_offset + copy.length].copy_(source)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> tuple[EngineCore, EngineCore]:
    return make_engine(tiny_llama_dir, 3 << 20), make_engine(tiny_llama_dir, 5 << 20)


def test_prefill_then_decode_equals_one_engine(
    engines: tuple[EngineCore, EngineCore], tiny_llama_dir: Path
) -> None:
    prefill, decode = engines
    assert prefill.kv_layout.fingerprint == decode.kv_layout.fingerprint
    assert prefill.kv_layout.num_blocks != decode.kv_layout.num_blocks
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 4096) for _ in range(n)] for n in (1, 15, 16, 17, 90, 150)]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    expected = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=4 << 20)
    expected_ids = [o.token_ids for o in expected.generate(prompts, params)]

    # Decode reserves first (design §2): no prefill work is spent on a request it cannot take.
    ids = [f"req-{i}" for i in range(len(prompts))]
    reservations = [decode.reserve(rid, p, params) for rid, p in zip(ids, prompts, strict=True)]
    reserved = {rid: r.block_ids for rid, r in zip(ids, reservations, strict=True) if r}
    assert len(reserved) == len(prompts)
    assert decode.stats().num_reserved == len(prompts)
    assert not decode.has_work  # nothing to compute until a commit

    first_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for rid, prompt in zip(ids, prompts, strict=True):
        prefill.add_request(rid, prompt, first_params, hold_kv=True)
    first_tokens: dict[str, int] = {}
    while prefill.has_unfinished_requests:
        for out in prefill.step():
            assert out.finished
            first_tokens[out.request_id] = out.new_token_ids[0]
    assert prefill.stats().num_held == len(prompts)

    for rid in ids:
        copy_pages(prefill, prefill.kv_block_ids(rid), decode, reserved[rid])
        assert prefill.release_kv(rid)
        decode.commit(rid, first_tokens[rid])
    assert prefill.stats().num_blocks_used == 0

    outputs = {rid: [first_tokens[rid]] for rid in ids}
    while decode.has_unfinished_requests:
        for out in decode.step():
            outputs[out.request_id].extend(out.new_token_ids)
    assert [outputs[rid] for rid in ids] == expected_ids
    assert decode.stats().num_blocks_used == 0


def test_reservation_refused_when_full_and_freed_by_abort(
    engines: tuple[EngineCore, EngineCore],
) -> None:
    _, decode = engines
    params = SamplingParams(max_tokens=4)
    num_free = decode.kv_cache.num_free_blocks
    block_size = decode.kv_layout.block_size
    big = [7] * 200
    taken = []
    while (reservation := decode.reserve(f"fill-{len(taken)}", big, params)) is not None:
        assert reservation.num_cached_blocks == 0  # nothing committed: nothing cached
        taken.append(reservation.block_ids)
    assert sum(len(b) for b in taken) <= num_free < (len(taken) + 1) * -(-200 // block_size)
    for i in range(len(taken)):
        assert decode.abort(f"fill-{i}")
    assert decode.stats().num_blocks_used == 0
    with pytest.raises(KeyError, match="holds no reservation"):
        decode.commit("fill-0", 5)


def test_commit_with_a_stopping_first_token_finishes_at_once(
    engines: tuple[EngineCore, EngineCore],
) -> None:
    _, decode = engines
    eos = decode.model_config.eos_token_ids[0]
    assert decode.reserve("eos", [9, 9, 9], SamplingParams(max_tokens=8)) is not None
    out = decode.commit("eos", eos)
    assert out.finished and out.finish_reason == "stop"
    assert decode.reserve("one", [9, 9, 9], SamplingParams(max_tokens=1)) is not None
    assert decode.commit("one", 11).finish_reason == "length"
    assert decode.stats().num_blocks_used == 0 and not decode.has_unfinished_requests


def test_aborting_a_held_prefill_releases_its_blocks(
    engines: tuple[EngineCore, EngineCore],
) -> None:
    prefill, _ = engines
    prefill.add_request("held", list(range(10, 60)), SamplingParams(max_tokens=1), hold_kv=True)
    while prefill.has_unfinished_requests:
        prefill.step()
    assert prefill.stats().num_held == 1 and prefill.stats().num_blocks_used > 0
    with pytest.raises(ValueError, match="already in use"):
        prefill.add_request("held", [1, 2], SamplingParams())
    assert prefill.abort("held")
    assert prefill.stats().num_blocks_used == 0 and prefill.stats().num_held == 0
    assert not prefill.release_kv("held")


def test_layouts_of_different_models_do_not_match(engines, tiny_model_factory) -> None:
    prefill, _ = engines
    qwen = LLM(
        tiny_model_factory("qwen3"), dtype="float32", max_model_len=256, kv_cache_memory=1 << 20
    )
    other: KvLayout = qwen.engine.kv_layout
    assert other.fingerprint != prefill.kv_layout.fingerprint
    with pytest.raises(ValueError, match="KV layouts differ"):
        layer_copies(prefill.kv_layout, [0], other, [0])


def hand_off(
    prefill: EngineCore, decode: EngineCore, rid: str, prompt: list[int], params: SamplingParams
) -> tuple[list[int], int]:
    """One request through reserve → prefill → copy of the blocks the decode engine lacks →
    commit → decode to the end: its tokens and how many blocks the reservation took cached."""
    reservation = decode.reserve(rid, prompt, params)
    assert reservation is not None
    first_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefill.add_request(rid, prompt, first_only, hold_kv=True)
    first: list[int] = []
    while prefill.has_unfinished_requests:
        for out in prefill.step():
            first.extend(out.new_token_ids)
    skip = reservation.num_cached_blocks
    copy_pages(prefill, prefill.kv_block_ids(rid)[skip:], decode, reservation.block_ids[skip:])
    assert prefill.release_kv(rid)
    tokens = list(first)
    decode.commit(rid, first[0])
    while decode.has_unfinished_requests:
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    return tokens, skip


def test_a_reservation_reuses_the_decode_engines_cached_prefix(tiny_llama_dir: Path) -> None:
    """A prompt whose prefix the decode engine already holds (a system prompt, a chat's
    earlier turns) takes those blocks from its prefix cache: only the rest is copied, and the
    tokens are still exactly one engine's."""
    prefill, decode = make_engine(tiny_llama_dir, 3 << 20), make_engine(tiny_llama_dir, 5 << 20)
    block_size = decode.kv_layout.block_size
    rng = random.Random(11)
    shared = [rng.randrange(5, 4096) for _ in range(3 * block_size + 5)]
    prompts = [shared + [rng.randrange(5, 4096) for _ in range(n)] for n in (9, 2 * block_size)]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    alone = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=4 << 20)
    expected = [o.token_ids for o in alone.generate(prompts, params)]

    first, skipped = hand_off(prefill, decode, "a", prompts[0], params)
    assert skipped == 0 and first == expected[0]
    hits_before = decode.stats().prefix_cache_hit_tokens
    second, skipped = hand_off(prefill, decode, "b", prompts[1], params)
    assert skipped == 3  # the shared prefix's full blocks; its partial fourth is pushed
    assert second == expected[1]
    assert decode.stats().prefix_cache_hit_tokens - hits_before == 3 * block_size
    assert decode.stats().num_blocks_used == 0

    # Another tenant's salt shares nothing (design: the prefix cache's salt).
    salted = SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, cache_salt="tenant-b"
    )
    tokens, skipped = hand_off(prefill, decode, "c", prompts[1], salted)
    assert skipped == 0 and tokens == expected[1]


def test_a_reserved_prefix_stays_cached_while_the_reservation_holds_it(
    tiny_llama_dir: Path,
) -> None:
    """The shared blocks are referenced by the reservation: aborting it gives them back to the
    prefix cache, not to the free pool's reuse, and an abort frees only the new blocks."""
    prefill, decode = make_engine(tiny_llama_dir, 3 << 20), make_engine(tiny_llama_dir, 5 << 20)
    block_size = decode.kv_layout.block_size
    prompt = list(range(100, 100 + 2 * block_size + 3))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    hand_off(prefill, decode, "a", prompt, params)
    reservation = decode.reserve("b", prompt, params)
    assert reservation is not None and reservation.num_cached_blocks == 2
    assert decode.stats().num_blocks_used == len(reservation.block_ids)
    assert decode.abort("b")
    assert decode.stats().num_blocks_used == 0
    again = decode.reserve("c", prompt, params)
    assert again is not None and again.block_ids[:2] == reservation.block_ids[:2]
    assert decode.abort("c")


def test_side_by_side_reservations_of_one_prefix_end_up_sharing_it(tiny_llama_dir: Path) -> None:
    """Two reservations made before either commit (a burst sharing a system prompt) each have
    the prefix pushed; the second's commit swaps its copy for the first's cached blocks, so the
    prefix is held once, and both still decode exactly as one engine."""
    prefill, decode = make_engine(tiny_llama_dir, 3 << 20), make_engine(tiny_llama_dir, 5 << 20)
    block_size = decode.kv_layout.block_size
    rng = random.Random(12)
    shared = [rng.randrange(5, 4096) for _ in range(3 * block_size)]
    prompts = [shared + [rng.randrange(5, 4096) for _ in range(n)] for n in (5, 9)]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    alone = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=4 << 20)
    expected = [o.token_ids for o in alone.generate(prompts, params)]

    reservations = [decode.reserve(f"r{i}", p, params) for i, p in enumerate(prompts)]
    assert all(r is not None and r.num_cached_blocks == 0 for r in reservations)
    first_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    firsts: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, first_only, hold_kv=True)
    while prefill.has_unfinished_requests:
        for out in prefill.step():
            firsts[out.request_id] = out.new_token_ids[0]
    held = sum(len(r.block_ids) for r in reservations if r is not None)
    assert decode.stats().num_blocks_used == held
    for i, reservation in enumerate(reservations):
        assert reservation is not None
        copy_pages(prefill, prefill.kv_block_ids(f"r{i}"), decode, reservation.block_ids)
        assert prefill.release_kv(f"r{i}")
        decode.commit(f"r{i}", firsts[f"r{i}"])
    assert decode.stats().num_blocks_used == held - 3  # the prefix's three blocks, once
    assert decode.kv_block_ids("r1")[:3] == decode.kv_block_ids("r0")[:3]
    outputs = {f"r{i}": [firsts[f"r{i}"]] for i in range(len(prompts))}
    while decode.has_unfinished_requests:
        for out in decode.step():
            outputs[out.request_id].extend(out.new_token_ids)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
    assert decode.stats().num_blocks_used == 0


def test_a_decode_engine_that_speculates_decodes_the_same_tokens(
    engines: tuple[EngineCore, EngineCore], tiny_llama_dir: Path
) -> None:
    """A committed request's first token came from the prefill node; its decode steps then
    carry proposals from its prompt and outputs like any other's."""
    prefill = engines[0]
    decode = make_engine(
        tiny_llama_dir,
        5 << 20,
        speculative_config={
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
            "prompt_lookup_min": 1,
        },  # fmt: skip
    )
    prompts = [[3, 4] * 15, [9, 10, 11, 12] * 5]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=4 << 20)
    expected_ids = [o.token_ids for o in expected.generate(prompts, params)]
    ids = [f"spec-{i}" for i in range(len(prompts))]
    first_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for rid, prompt in zip(ids, prompts, strict=True):
        reservation = decode.reserve(rid, prompt, params)
        assert reservation is not None
        prefill.add_request(rid, prompt, first_params, hold_kv=True)
        while prefill.has_unfinished_requests:
            (out,) = prefill.step()
        copy_pages(prefill, prefill.kv_block_ids(rid), decode, reservation.block_ids)
        assert prefill.release_kv(rid)
        first = decode.commit(rid, out.new_token_ids[0])
        outputs[rid] = list(first.new_token_ids)
    while decode.has_unfinished_requests:
        for out in decode.step():
            outputs[out.request_id].extend(out.new_token_ids)
    assert [outputs[rid] for rid in ids] == expected_ids
    stats = decode.stats()
    assert stats.num_accepted_tokens_total > 0
    assert stats.num_blocks_used == 0
