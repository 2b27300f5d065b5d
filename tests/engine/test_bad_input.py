"""Bad input is refused with a ValueError naming the field, and leaves the engine clean."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from services.convert import PARAM_METADATA_KEY, refusal_metadata
from services.engine import LLM, CacheConfig, EngineConfig, EngineCore, SamplingParams
from services.engine.config import SchedulerConfig
from services.types import FinishReason, SamplingParamError

VOCAB_SIZE = 4096
MAX_MODEL_LEN = 64
# bfloat16 KV of the tiny model (kv_cache_dtype auto on CPU): 4 layers x 2 KV heads x 32 dims
# x K and V x 2 bytes = 1 KiB a token, so 1 MiB holds 1024 tokens.
KV_CACHE_MEMORY = 1 << 20
PROMPT = [0, 11, 222, 3333]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(
        tiny_llama_dir,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        kv_cache_memory=KV_CACHE_MEMORY,
    )


def assert_engine_clean(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_blocks_used == 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert not llm.engine.has_unfinished_requests


def assert_refused(llm: LLM, prompts, params, match: str) -> None:
    """The call fails naming the problem, leaves nothing behind, and the engine still works."""
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params)
    assert_engine_clean(llm)
    [output] = llm.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(output.token_ids) == 2
    assert output.finish_reason is FinishReason.LENGTH
    assert_engine_clean(llm)


# --- prompts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([], "prompt_token_ids is empty"),
        ([1] * (MAX_MODEL_LEN + 1), r"prompt_token_ids has 65 tokens, max_model_len is 64"),
        ([1, VOCAB_SIZE], r"prompt_token_ids\[1\] = 4096 is outside the vocabulary"),
        ([1, 2, -1], r"prompt_token_ids\[2\] = -1 is outside the vocabulary"),
        ([1, 2.0], r"prompt_token_ids\[1\] is not an integer"),
        ([1, "2"], r"prompt_token_ids\[1\] is not an integer"),
        ([True, 2], r"prompt_token_ids\[0\] is not an integer"),
        ([2, 1 << 70], r"prompt_token_ids\[1\] = 1180591620717411303424 is outside"),
        (np.array([3, VOCAB_SIZE + 3]), r"prompt_token_ids\[1\] = 4099 is outside"),
    ],
)
def test_bad_prompt_is_refused(llm: LLM, prompt: list, match: str) -> None:
    # The bad prompt comes second: the good one before it must not be left queued.
    assert_refused(llm, [PROMPT, prompt], SamplingParams(max_tokens=2), match)


def test_prompt_of_max_model_len_is_accepted(llm: LLM) -> None:
    [output] = llm.generate([[5] * MAX_MODEL_LEN], SamplingParams(max_tokens=4))
    # No room for more than the one token sampled from the full context.
    assert len(output.token_ids) == 1
    assert output.finish_reason is FinishReason.LENGTH
    assert_engine_clean(llm)


# --- sampling parameters ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"stop_token_ids": ["7"]}, "stop_token_ids"),
        ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, "7"]}, "allowed_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": b"salt"}, "cache_salt"),
        ({"cache_salt": "\ud800"}, "cache_salt"),
        ({"seed": 1.0}, "seed"),
        # torch.Generator.manual_seed's range, [-2**63, 2**64 - 1]: past it torch raises mid-step.
        ({"seed": 2**64}, "seed must be <= 18446744073709551615"),
        ({"seed": -(2**63) - 1}, "seed must be >= -9223372036854775808"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": "57"}, "stop_token_ids must be a list of token ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids must be a list of token ids"),
        ({"allowed_token_ids": {5: 1}}, "allowed_token_ids must be a list of token ids"),
        ({"logit_bias": [5]}, r"logit_bias must map token ids to biases .* the entry 5"),
        ({"logit_bias": [(5, 1.0, 2)]}, "logit_bias must map token ids to biases"),
        ({"logit_bias": 5}, "logit_bias must map token ids to biases"),
        ({"logit_bias": {"a": 1.0, 2: 1.0}}, "logit_bias must be an integer"),
        ({"priority": "high"}, "priority"),
        ({"bad_words_token_ids": [[]]}, r"bad_words_token_ids\[0\] is empty"),
        ({"bad_words_token_ids": [[1, -2]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [5]}, r"bad_words_token_ids\[0\] must be a list"),
        ({"bad_words_token_ids": ["ab"]}, r"bad_words_token_ids\[0\] must be a list"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingParamError, match=field) as refused:
        SamplingParams(**kwargs)
    assert str(refused.value).startswith(refused.value.param)  # the message names the field


@pytest.mark.parametrize(
    "name", ["stop_token_ids", "allowed_token_ids", "logit_bias", "bad_words_token_ids"]
)
def test_none_is_an_unset_list(name: str) -> None:
    # vLLM's default for these fields is None.
    assert SamplingParams(**{name: None}) == SamplingParams()


def test_logit_bias_is_a_dict_or_pairs() -> None:
    expected = ((3, -1.0), (5, 2.0))
    assert SamplingParams(logit_bias={5: 2.0, 3: -1.0}).logit_bias == expected
    assert SamplingParams(logit_bias=[(5, 2.0), [3, -1.0]]).logit_bias == expected


def test_seeds_at_torchs_bounds_sample_beside_other_requests(llm: LLM) -> None:
    # 2**64 - 1 and -(2**63) are the last seeds manual_seed takes (one past them crashed the
    # step, and the valid prompts of the batch with it).
    params = [
        SamplingParams(max_tokens=3, ignore_eos=True, seed=1),
        SamplingParams(max_tokens=3, ignore_eos=True, seed=2**64 - 1),
        SamplingParams(max_tokens=3, ignore_eos=True, seed=-(2**63)),
    ]
    outputs = llm.generate([PROMPT] * 3, params)
    assert [len(output.token_ids) for output in outputs] == [3, 3, 3]
    # A seed gives its tokens: the same again, alone.
    [alone] = llm.generate([PROMPT], params[1])
    assert alone.token_ids == outputs[1].token_ids
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop_token_ids": [VOCAB_SIZE]}, r"stop_token_ids has token id 4096, outside"),
        ({"logprobs": VOCAB_SIZE + 1}, r"logprobs must be <= vocab size 4096"),
        ({"prompt_logprobs": VOCAB_SIZE + 1}, r"prompt_logprobs must be <= vocab size 4096"),
        ({"allowed_token_ids": [5, VOCAB_SIZE]}, r"allowed_token_ids has token id 4096, outside"),
        ({"bad_words_token_ids": [[5], [6, VOCAB_SIZE]]}, r"bad_words_token_ids\[1\] has token"),
        ({"logit_bias": {VOCAB_SIZE: 1.0}}, r"logit_bias has token id 4096, outside"),
    ],
)
def test_params_beyond_the_vocabulary_are_refused(llm: LLM, kwargs: dict, match: str) -> None:
    assert_refused(llm, [PROMPT], SamplingParams(**kwargs), match)


def test_allowed_token_ids_are_all_the_engine_samples(llm: LLM) -> None:
    allowed = (7, 11, 300, 4095)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, allowed_token_ids=allowed)
    (output,) = llm.generate([PROMPT], params)
    assert len(output.token_ids) == 24 and set(output.token_ids) <= set(allowed)
    assert_engine_clean(llm)


def test_bad_words_change_the_greedy_output_where_they_would_complete(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (plain,) = llm.generate([PROMPT], greedy)
    first, second = plain.token_ids[:2]
    # The first token (sampled in the prefill step) can be banned as a word of one token.
    banned = dataclasses.replace(greedy, bad_words_token_ids=((first,),))
    (output,) = llm.generate([PROMPT], banned)
    assert first not in output.token_ids
    # A word of two: its first token is still free, the second not after it.
    banned = dataclasses.replace(greedy, bad_words_token_ids=((first, second),))
    (output,) = llm.generate([PROMPT], banned)
    assert output.token_ids[0] == first and output.token_ids[1] != second
    assert_engine_clean(llm)


def test_allowed_tokens_that_bad_words_ban_are_refused(llm: LLM) -> None:
    # Every logit would be -inf: greedy returned token 0, a draw the last id, neither allowed.
    for params in (
        SamplingParams(
            max_tokens=4, temperature=0.0, allowed_token_ids=[5], bad_words_token_ids=[[5]]
        ),
        SamplingParams(max_tokens=4, allowed_token_ids=[5, 9], bad_words_token_ids=[[9], [7], [5]]),
    ):
        assert_refused(llm, [PROMPT], params, "bad_words_token_ids ban every token")
        with pytest.raises(SamplingParamError) as refused:
            llm.engine.add_request("x", PROMPT, params)
        # A node answers it INVALID_ARGUMENT naming the field, which the gateway passes on (400).
        assert refusal_metadata(refused.value) == ((PARAM_METADATA_KEY, "bad_words_token_ids"),)
    assert_engine_clean(llm)
    # One allowed token left free, or a longer word only banning it after its first token:
    # the sampler has something to draw from, and draws only allowed tokens.
    for params in (
        SamplingParams(max_tokens=4, allowed_token_ids=[5, 9], bad_words_token_ids=[[5]], seed=0),
        SamplingParams(max_tokens=4, allowed_token_ids=[5], bad_words_token_ids=[[6, 5]], seed=0),
    ):
        (output,) = llm.generate([PROMPT], params)
        assert len(output.token_ids) == 4 and set(output.token_ids) <= {5, 9}


def test_allowed_tokens_that_bad_words_and_min_tokens_forbid_are_refused(llm: LLM) -> None:
    # 5 is banned, EOS forbidden until min_tokens: nothing to sample for the first tokens.
    eos = llm.engine.model_config.eos_token_ids[0]
    params = SamplingParams(
        max_tokens=4, min_tokens=2, allowed_token_ids=[eos, 5], bad_words_token_ids=[[5]]
    )
    assert_refused(llm, [PROMPT], params, "ids that bad_words_token_ids ban, and EOS")
    # The gateway runs the same check before routing.
    assert params.min_tokens_conflict((eos,)) is not None


def test_allowed_tokens_that_min_tokens_forbids_are_refused(llm: LLM) -> None:
    # The sampler would have nothing to draw from before min_tokens.
    eos = llm.engine.model_config.eos_token_ids[0]
    for params in (
        SamplingParams(min_tokens=2, allowed_token_ids=[eos]),
        SamplingParams(min_tokens=2, stop_token_ids=[9], allowed_token_ids=[eos, 9]),
    ):
        assert_refused(llm, [PROMPT], params, "no token could be sampled")
    (output,) = llm.generate([PROMPT], SamplingParams(max_tokens=2, allowed_token_ids=[eos]))
    assert output.token_ids == [eos]  # without min_tokens it is simply the only choice


def test_priority_is_refused_unless_the_engine_schedules_by_it(
    llm: LLM, tiny_llama_dir: Path
) -> None:
    # Under fcfs a priority would be silently ignored (vLLM refuses it the same way).
    assert_refused(llm, [PROMPT], SamplingParams(max_tokens=2, priority=-3), "priority -3 needs")
    by_priority = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=KV_CACHE_MEMORY,
        scheduling_policy="priority",
    )
    (output,) = by_priority.generate([PROMPT], SamplingParams(max_tokens=2, priority=-3))
    assert len(output.token_ids) == 2
    assert_engine_clean(by_priority)


def test_params_list_of_the_wrong_length_is_refused(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=2)] * 3
    assert_refused(llm, [PROMPT, PROMPT], params, r"got 3 SamplingParams for 2 prompts")


def test_a_bad_request_in_a_batch_queues_none_of_it(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=2), SamplingParams(stop_token_ids=[VOCAB_SIZE + 5])]
    assert_refused(llm, [PROMPT, PROMPT], params, "stop_token_ids")


def test_an_error_mid_generation_leaves_nothing_queued(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = llm.engine.runner
    execute = runner.execute
    calls = []

    def fail_on_third_step(output):
        calls.append(output)
        if len(calls) == 3:
            raise RuntimeError("model exploded")
        return execute(output)

    monkeypatch.setattr(runner, "execute", fail_on_third_step)
    with pytest.raises(RuntimeError, match="model exploded"):
        llm.generate([PROMPT, PROMPT[:2]], SamplingParams(max_tokens=8, ignore_eos=True))
    monkeypatch.undo()

    assert len(calls) == 3
    assert_engine_clean(llm)
    [output] = llm.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(output.token_ids) == 2


def test_engine_core_refuses_bad_requests(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("", PROMPT, SamplingParams())
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        engine.add_request("x", PROMPT, {"max_tokens": 2})
    engine.add_request("dup", PROMPT, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.add_request("dup", PROMPT, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests:
        engine.step()
    assert_engine_clean(llm)


# --- engine construction ---------------------------------------------------------------------


def test_kv_cache_smaller_than_max_model_len_is_refused(tiny_llama_dir: Path) -> None:
    # 16 KiB is 16 tokens of bf16 KV: a quarter of one max_model_len sequence.
    with pytest.raises(ValueError, match="max_model_len=64"):
        LLM(
            tiny_llama_dir,
            dtype="float32",
            block_size=4,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory=16 << 10,
        )


def test_kv_cache_without_a_single_block_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=100)


def test_max_model_len_beyond_the_model_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=4096, kv_cache_memory=KV_CACHE_MEMORY)


@pytest.mark.parametrize(
    ("make_config", "field"),
    [
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: CacheConfig(block_size=-16), "block_size"),
        (lambda: CacheConfig(kv_cache_memory=0), "kv_cache_memory"),
        (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (lambda: SchedulerConfig(policy="lifo"), "lifo"),
        (lambda: EngineConfig(model_dir="m", dtype="float64"), "dtype"),
        (lambda: EngineConfig(model_dir="m", device="tpu"), "device"),
        (lambda: EngineConfig(model_dir="m", max_model_len=0), "max_model_len"),
        # Each type up front, naming the field: a wrong one failed deep in torch, or (a str
        # for a bool, True for 1, a fractional length) was taken silently.
        (lambda: CacheConfig(block_size=True), "block_size must be a positive integer, got True"),
        (lambda: CacheConfig(block_size=16.0), "block_size must be a positive integer"),
        (lambda: CacheConfig(kv_cache_memory=6.4e7), "kv_cache_memory must be an integer"),
        (lambda: CacheConfig(kv_cache_memory=True), "kv_cache_memory must be an integer"),
        (lambda: CacheConfig(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a"),
        (lambda: CacheConfig(gpu_memory_utilization=True), "gpu_memory_utilization must be a"),
        (lambda: CacheConfig(enable_prefix_caching="no"), "enable_prefix_caching must be True"),
        (lambda: CacheConfig(enable_prefix_caching=1), "enable_prefix_caching must be True"),
        (lambda: SchedulerConfig(max_num_seqs=True), "max_num_seqs must be a positive integer"),
        (lambda: SchedulerConfig(max_num_batched_tokens=8.0), "max_num_batched_tokens must be"),
        (lambda: EngineConfig(model_dir="m", max_model_len="64"), "max_model_len must be a pos"),
        (lambda: EngineConfig(model_dir="m", max_model_len=64.5), "max_model_len must be a pos"),
        (lambda: EngineConfig(model_dir="m", max_model_len=True), "max_model_len must be a pos"),
        (lambda: EngineConfig(model_dir="m", seed=1.5), "seed must be an integer or None"),
        (lambda: EngineConfig(model_dir="m", seed=True), "seed must be an integer or None"),
        (lambda: EngineConfig(model_dir="m", seed=2**64), r"seed must be in \[-2\*\*63"),
        (lambda: EngineConfig(model_dir="m", seed=-(2**63) - 1), r"seed must be in \[-2\*\*63"),
        (lambda: EngineConfig(model_dir="m", cuda_graphs="no"), "cuda_graphs must be True"),
        (lambda: EngineConfig(model_dir="m", device="cudax"), "device must be"),
        (lambda: EngineConfig(model_dir="m", device="cuda:"), "device must be"),
        (lambda: EngineConfig(model_dir="m", device=None), "device must be"),
        (lambda: EngineConfig(model_dir=None), "model_dir must be a path"),
    ],
)
def test_bad_engine_config_is_refused(make_config, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_config()


def test_seeds_and_devices_a_config_takes() -> None:
    # seed None: no fixed seed (vLLM's); any seed torch takes. A CUDA device is checked when an
    # engine starts, not here: a GPU node's config may be built where there is no GPU.
    for seed in (None, 0, -(2**63), 2**64 - 1):
        assert EngineConfig(model_dir="m", seed=seed).seed == seed
    for device in ("cpu", "cuda", "cuda:1"):
        assert EngineConfig(model_dir="m", device=device).device == device


def test_llm_with_block_size_zero_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_llama_dir, dtype="float32", block_size=0, kv_cache_memory=KV_CACHE_MEMORY)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": True}, "block_size"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"kv_cache_memory": 6.4e7}, "kv_cache_memory"),
        ({"max_model_len": "64"}, "max_model_len"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
        ({"max_num_seqs": 2.0}, "max_num_seqs"),
        ({"device": None}, "device"),
    ],
)
def test_llm_arguments_of_the_wrong_type_are_refused_by_name(
    tiny_llama_dir: Path, kwargs: dict, match: str
) -> None:
    kwargs = {"kv_cache_memory": KV_CACHE_MEMORY, **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama_dir, dtype="float32", **kwargs)


def test_cuda_without_cuda_is_refused_naming_the_device(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Torch failed deep in the weights' load instead (an AssertionError on a CPU-only build, an
    # AttributeError from set_device), naming no argument.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=f"device '{device}': CUDA is not available"):
            LLM(tiny_llama_dir, device=device, kv_cache_memory=KV_CACHE_MEMORY)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="device 'cuda:1': CUDA sees 1 GPU"):
        LLM(tiny_llama_dir, device="cuda:1", kv_cache_memory=KV_CACHE_MEMORY)


def test_model_paths_that_are_no_model_say_what_they_are(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model_dir must be a path"):
        LLM(None)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "no-such-model")
    text = tmp_path / "model.txt"
    text.write_text("not a model")
    with pytest.raises(FileNotFoundError, match="is a file, but not a GGUF file"):
        LLM(text)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(tmp_path)


# --- aborts through the engine ---------------------------------------------------------------


def test_abort_running_and_waiting_requests_mid_generation(tiny_llama_dir: Path) -> None:
    engine = EngineCore(
        EngineConfig(
            model_dir=tiny_llama_dir,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            cache=CacheConfig(block_size=4, kv_cache_memory=KV_CACHE_MEMORY),
            scheduler=SchedulerConfig(max_num_seqs=1),
        )
    )
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for request_id in ("running", "waiting", "survivor"):
        engine.add_request(request_id, PROMPT, params)
    outputs = [out for _ in range(3) for out in engine.step()]
    assert {out.request_id for out in outputs} == {"running"}
    assert engine.stats().num_running == 1 and engine.stats().num_waiting == 2
    assert engine.stats().num_blocks_used > 0

    assert engine.abort("running")
    assert engine.abort("waiting")
    assert not engine.abort("waiting")  # already gone

    stats = engine.stats()
    assert stats.num_blocks_used == 0
    assert stats.num_running == 0 and stats.num_waiting == 1
    tokens: dict[str, list[int]] = {}
    finish_reasons = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish_reasons[out.request_id] = out.finish_reason
    assert set(tokens) == {"survivor"}
    assert len(tokens["survivor"]) == 6
    assert finish_reasons == {"survivor": FinishReason.LENGTH}
    assert engine.stats().num_blocks_used == 0


def test_numpy_integer_token_ids_are_accepted(llm: LLM) -> None:
    import numpy as np

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    [from_numpy] = llm.generate([np.array(PROMPT, dtype=np.int64)], params)
    [from_list] = llm.generate([PROMPT], params)
    assert from_numpy.token_ids == from_list.token_ids
    assert all(type(t) is int for t in from_numpy.prompt_token_ids + from_numpy.token_ids)
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([5, 6], "prompt_token_ids must be a list"),
        ([None], "prompt_token_ids must be a list"),
        (7, "prompts must be a string or a list of prompts"),
    ],
)
def test_prompts_that_are_neither_text_nor_token_ids_are_refused(
    llm: LLM, prompts, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert_engine_clean(llm)


def test_vllm_tokens_prompts_are_prompts(llm: LLM) -> None:
    # vLLM's TokensPrompt: a list of them, one alone, or mixed with plain lists.
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    [expected] = llm.generate([PROMPT], greedy)
    [alone] = llm.generate({"prompt_token_ids": PROMPT}, greedy)
    listed = llm.generate([{"prompt_token_ids": PROMPT}, PROMPT], greedy)
    assert [o.token_ids for o in (alone, *listed)] == [expected.token_ids] * 3
    assert alone.prompt_token_ids == PROMPT
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([PROMPT, {"prompt_token_ids": PROMPT, "multi_modal_data": {}}], "prompt 1 is a dict"),
        ({"prompt_token_ids": "text"}, "prompt_token_ids must be a list of token ids"),
        ([{"prompt_token_ids": [1, VOCAB_SIZE]}], r"prompt_token_ids\[1\] = 4096 is outside"),
    ],
)
def test_tokens_prompts_that_are_not_token_ids_are_refused(llm: LLM, prompts, match: str) -> None:
    assert_refused(llm, prompts, SamplingParams(max_tokens=2), match)


def test_params_may_be_any_iterable_of_sampling_params(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([PROMPT, PROMPT], (p for p in [greedy, greedy]))
    assert [len(o.token_ids) for o in outputs] == [2, 2]
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"max_tokens": 2}, "params must be SamplingParams or a list of them, got dict"),
        ("greedy", "params must be SamplingParams or a list of them, got str"),
        (2, "params must be SamplingParams or a list of them, got int"),
        ([SamplingParams(), {"max_tokens": 2}], r"params\[1\] must be SamplingParams, got dict"),
        ((p for p in [SamplingParams()] * 3), "got 3 SamplingParams for 2 prompts"),
    ],
)
def test_params_that_are_not_sampling_params_are_refused(llm: LLM, params, match: str) -> None:
    assert_refused(llm, [PROMPT, PROMPT], params, match)
