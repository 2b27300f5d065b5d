"""Guided decoding in the engine: the grammar holds whatever the (random) weights prefer, on the
CPU and on a GPU where there is one; the first token is constrained too, and a request's output is
the same colocated, disaggregated (prefill engine → pages → decode engine's commit) and recomputed
on the decode engine."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from services.engine import LLM, EngineCore, SamplingParams
from services.engine.kv_layout import layer_copies
from services.engine.sampler import Sampler, SamplingMetadata
from services.guided_decoding import MAX_CHOICES, GuidedDecoding, GuidedKind

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
PROMPT = [11, 400, 27, 3000, 12, 9]


def make_llm(model_dir: Path, kv_cache_memory: int = 4 << 20, device: str = "cpu") -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=256, kv_cache_memory=kv_cache_memory,
               device=device)  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def cuda_llm(tiny_llama_dir: Path) -> LLM:
    """Built only when a gpu test asks for it: on a CPU-only host those are skipped first."""
    return make_llm(tiny_llama_dir, device="cuda")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def llm_on_device(request: pytest.FixtureRequest) -> LLM:
    """The module's engine on each device: the grammar's bitmask masks the logits where they are
    (on a GPU, without copying them back)."""
    return request.getfixturevalue("llm" if request.param == "cpu" else "cuda_llm")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))


def generate(llm: LLM, guided: GuidedDecoding, **kwargs: object) -> tuple[list[int], str]:
    params = SamplingParams(**{"max_tokens": 120, **kwargs}, guided=guided)  # type: ignore[arg-type]
    (out,) = llm.generate([PROMPT], params)
    return out.token_ids, out.finish_reason


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_is_valid_and_stops(llm_on_device, tokenizer, seed) -> None:
    llm = llm_on_device
    token_ids, reason = generate(llm, GuidedDecoding.json_schema(SCHEMA), seed=seed)
    assert reason == "stop"
    value = json.loads(tokenizer.decode(token_ids))
    assert set(value) == set(SCHEMA["properties"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert isinstance(value["ok"], bool)
    assert set(value["tags"]) <= {"a", "b"} and len(value["tags"]) <= 3
    assert len(llm.engine.structured_outputs) == 0  # the matcher went with the request


def test_choice_regex_and_grammar(llm_on_device, tokenizer) -> None:
    llm = llm_on_device
    choices = ["yes", "no", "maybe not"]
    for seed in range(4):
        token_ids, reason = generate(llm, GuidedDecoding.choice(choices), seed=seed)
        assert tokenizer.decode(token_ids) in choices and reason == "stop"
    token_ids, reason = generate(
        llm, GuidedDecoding(GuidedKind.REGEX, r"[0-9]{3}-[a-z]{2}"), temperature=0.0
    )
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", tokenizer.decode(token_ids)) and reason == "stop"
    lark = 'start: "(" item ("," item)* ")"\nitem: /[xy]/'
    token_ids, _ = generate(llm, GuidedDecoding(GuidedKind.GRAMMAR, lark), seed=5, max_tokens=12)
    assert re.fullmatch(r"\([xy](,[xy])*\)?", tokenizer.decode(token_ids))


def test_unconstrained_output_would_break_the_grammar(llm, tokenizer) -> None:
    # Not vacuous: left alone, the random model writes no JSON at all.
    (free,) = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0))
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(free.token_ids))


@pytest.mark.parametrize(
    ("guided", "field"),
    [
        (GuidedDecoding(GuidedKind.REGEX, "[a-"), "guided.regex"),
        (GuidedDecoding(GuidedKind.GRAMMAR, "start: nowhere"), "guided.grammar"),
        (GuidedDecoding.json_schema({"type": "objekt"}), "guided.json_schema"),
    ],
)
def test_a_bad_grammar_is_refused_before_the_request_holds_anything(llm, guided, field) -> None:
    engine = llm.engine
    params = SamplingParams(guided=guided)
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.add_request("bad", PROMPT, params)
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.reserve("bad", PROMPT, params)
    assert not engine.has_unfinished_requests and engine.stats().num_blocks_used == 0
    assert len(engine.structured_outputs) == 0


def test_a_grammar_is_translated_and_compiled_once_per_request(llm, monkeypatch) -> None:
    """The node's compile is the check: a validation before it cost half again its time."""
    calls: list[GuidedKind] = []
    to_grammar = GuidedDecoding.to_grammar

    def counting(guided: GuidedDecoding) -> str:
        calls.append(guided.kind)
        return to_grammar(guided)

    monkeypatch.setattr(GuidedDecoding, "to_grammar", counting)
    engine = llm.engine
    engine.add_request("once", PROMPT, SamplingParams(guided=GuidedDecoding.choice(["a", "b"])))
    assert calls == [GuidedKind.CHOICE]
    engine.abort("once")


def test_spec_shapes_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="guided.choice"):
        GuidedDecoding(GuidedKind.CHOICE, '["a", 3]')
    # Past llguidance's symbol limit a grammar passes its validation and fails to compile.
    with pytest.raises(ValueError, match=f"at most {MAX_CHOICES}"):
        GuidedDecoding.choice([str(i) for i in range(MAX_CHOICES + 1)])
    assert GuidedDecoding.choice([str(i) for i in range(MAX_CHOICES)]).kind is GuidedKind.CHOICE
    with pytest.raises(ValueError, match="guided.json_schema"):
        GuidedDecoding(GuidedKind.JSON_SCHEMA, "{not json")
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((5, 101.0),))


def _copy_pages(src: EngineCore, src_ids: list[int], dst: EngineCore, dst_ids: list[int]) -> None:
    src_bytes = [cache.view(-1).view(torch.uint8) for cache in src.kv_caches]
    dst_bytes = [cache.view(-1).view(torch.uint8) for cache in dst.kv_caches]
    for copy in layer_copies(src.kv_layout, src_ids, dst.kv_layout, dst_ids):
        source = src_bytes[copy.layer][copy.src_offset : copy.src_offset + copy.length]
        dst_bytes[copy.layer][copy.dst_offset : copy.dst_offset + copy.length].copy_(source)


def _drain(engine: EngineCore, outputs: dict[str, list[int]]) -> dict[str, str]:
    reasons = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return reasons


def test_disaggregated_and_recomputed_outputs_equal_colocated(llm, tiny_llama_dir) -> None:
    guided = GuidedDecoding.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=120, guided=guided, seed=s) for s in range(3)]
    params.append(SamplingParams(max_tokens=120, guided=guided, temperature=0.0))
    prompts = [PROMPT, PROMPT[:3], list(range(20, 60)), PROMPT]
    expected = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]

    prefill = make_llm(tiny_llama_dir, 3 << 20).engine
    decode = make_llm(tiny_llama_dir, 5 << 20).engine
    ids = [f"r{i}" for i in range(len(prompts))]
    reservations = [
        decode.reserve(rid, prompt, p) for rid, prompt, p in zip(ids, prompts, params, strict=True)
    ]
    reserved = {rid: r.block_ids for rid, r in zip(ids, reservations, strict=True) if r}
    firsts: dict[str, int] = {}
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        prefill.add_request(rid, prompt, dataclasses.replace(p, max_tokens=1), hold_kv=True)
    while prefill.has_unfinished_requests:
        for out in prefill.step():
            firsts[out.request_id] = out.new_token_ids[0]
    outputs = {rid: [firsts[rid]] for rid in ids}
    reasons = {}
    for rid in ids:
        _copy_pages(prefill, prefill.kv_block_ids(rid), decode, reserved[rid])
        prefill.release_kv(rid)
        out = decode.commit(rid, firsts[rid])
        if out.finished:
            reasons[rid] = out.finish_reason
    reasons.update(_drain(decode, outputs))
    assert [(outputs[rid], reasons[rid]) for rid in ids] == expected

    # Recomputed: the decode engine takes the whole request itself (a failed handoff).
    recomputed = {f"re{i}": [] for i in range(len(prompts))}
    for (rid, prompt), p in zip(zip(recomputed, prompts, strict=True), params, strict=True):
        decode.add_request(rid, prompt, p)
    reasons = _drain(decode, recomputed)
    assert [(recomputed[rid], reasons[rid]) for rid in recomputed] == expected
    for engine in (prefill, decode):
        assert engine.stats().num_blocks_used == 0 and len(engine.structured_outputs) == 0


def test_commit_refuses_a_first_token_outside_the_grammar(llm) -> None:
    engine = llm.engine
    guided = GuidedDecoding(GuidedKind.REGEX, "[0-9]+")
    assert engine.reserve("c", PROMPT, SamplingParams(guided=guided)) is not None
    # EOS is not a digit, and the grammar needs one first.
    assert not engine.structured_outputs.is_allowed("c", engine.model_config.eos_token_ids[0])
    with pytest.raises(ValueError, match="not allowed by the request's grammar"):
        engine.commit("c", engine.model_config.eos_token_ids[0])
    assert engine.abort("c") and len(engine.structured_outputs) == 0


def test_sampler_masks_constrained_rows_only_and_adds_logit_bias() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    # Row 1 may take only tokens 5 and 40 (word 0 bit 5, word 1 bit 8).
    bitmask = torch.tensor([[1 << 5, 1 << 8, 0]], dtype=torch.int32)
    params = [SamplingParams(temperature=0.0)] * 2 + [
        SamplingParams(temperature=0.0, logit_bias=((7, 100.0),))
    ]
    metadata = SamplingMetadata(
        params=params,
        prompt_token_ids=[[1]] * 3,
        output_token_ids=[[]] * 3,
        generators=[None] * 3,
        grammar_bitmask=bitmask,
        grammar_rows=(1,),
    )
    result = Sampler(eos_token_ids=[0])(logits, metadata)
    assert result.token_ids[0] == int(logits[0].argmax())  # untouched
    assert result.token_ids[1] == (5 if logits[1, 5] > logits[1, 40] else 40)
    assert result.token_ids[2] == 7
