"""vLLM's offline options that act on text and prompts, not on the engine's sampling: a
progress bar (``use_tqdm``), per-prompt ``priority``, and ``SamplingParams``'
``skip_special_tokens``, ``detokenize``, ``truncate_prompt_tokens``, ``bad_words`` and
``structured_outputs``. Each is checked by what it does to the outputs, against the same call
without it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gateway.text.tokenizer import Tokenizer
from services.convert import sampling_params_to_proto
from services.engine import LLM, BeamSearchParams, EngineConfigError, SamplingParams
from services.types import SamplingParamError, StructuredOutputsParams
from support.small_llm import small_llm

TEXT = "The quick brown fox jumps over"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return small_llm(tiny_llama_dir)


class RecordingBar:
    """A tqdm-like bar that remembers how it was made and used."""

    made: list[RecordingBar] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.updates: list[int] = []
        self.postfixes: list[str] = []
        self.closed = False
        RecordingBar.made.append(self)

    def update(self, n: int) -> None:
        self.updates.append(n)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfixes.append(text)

    def close(self) -> None:
        self.closed = True


def test_use_tqdm_counts_prompts_done_with_their_speeds(llm: LLM) -> None:
    RecordingBar.made.clear()
    params = [GREEDY, SamplingParams(max_tokens=4, temperature=0.8, seed=1, n=3)]
    outputs = llm.generate([TEXT, "another prompt"], params, use_tqdm=RecordingBar)
    (bar,) = RecordingBar.made
    assert bar.kwargs["total"] == 2  # prompts, not the four requests n = 3 makes
    assert bar.kwargs["desc"] == "Processed prompts"
    assert bar.updates == [1, 1] and bar.closed
    output_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    assert output_tokens == 8 + 3 * 4
    rates = [float(x) for x in re.findall(r"([\d.]+) toks/s", bar.postfixes[-1])]
    assert len(rates) == 2 and all(rate > 0 for rate in rates)


def test_use_tqdm_shows_a_bar_on_stderr_unless_false(
    llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    llm.generate(TEXT, GREEDY)  # vLLM's default: a bar
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(TEXT, GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    (out,) = llm.chat([{"role": "user", "content": TEXT}], GREEDY, use_tqdm=False)
    assert out.token_ids
    assert "Processed prompts" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="use_tqdm must be"):
        llm.generate(TEXT, GREEDY, use_tqdm="yes")  # type: ignore[arg-type]


def test_priority_is_one_per_prompt_and_needs_the_priority_policy(
    llm: LLM, tiny_llama_dir: Path
) -> None:
    with pytest.raises(SamplingParamError, match="priority 1 needs the priority scheduling"):
        llm.generate([TEXT, TEXT], GREEDY, priority=[0, 1], use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate([TEXT, TEXT], GREEDY, priority=[0], use_tqdm=False)
    ranked = small_llm(tiny_llama_dir, scheduling_policy="priority")
    first, second = ranked.generate([TEXT, TEXT], GREEDY, priority=[3, -2], use_tqdm=False)
    assert first.token_ids == second.token_ids == llm.generate(TEXT, GREEDY)[0].token_ids


def test_skip_special_tokens_false_keeps_them_in_the_text(llm: LLM) -> None:
    assert llm.tokenizer is not None
    special = llm.tokenizer.token_to_id("<|im_start|>")
    assert special is not None
    forced = SamplingParams(max_tokens=3, temperature=0.0, allowed_token_ids=[special])
    (skipped,) = llm.generate(TEXT, forced, use_tqdm=False)
    (kept,) = llm.generate(
        TEXT, SamplingParams(**{**_fields(forced), "skip_special_tokens": False}), use_tqdm=False
    )
    assert skipped.token_ids == kept.token_ids == [special] * 3
    assert skipped.text == ""
    assert kept.text == "<|im_start|>" * 3


def test_detokenize_false_gives_tokens_without_text(llm: LLM) -> None:
    (plain,) = llm.generate(TEXT, GREEDY, use_tqdm=False)
    (bare,) = llm.generate(
        TEXT, SamplingParams(**{**_fields(GREEDY), "detokenize": False}), use_tqdm=False
    )
    assert bare.token_ids == plain.token_ids and plain.text
    assert bare.text is None and bare.outputs[0].text is None
    with pytest.raises(SamplingParamError, match="stop strings are matched in the text"):
        SamplingParams(stop=["x"], detokenize=False)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm: LLM) -> None:
    (whole,) = llm.generate(TEXT, GREEDY, use_tqdm=False)
    cut = SamplingParams(**{**_fields(GREEDY), "truncate_prompt_tokens": 3})
    (out,) = llm.generate(TEXT, cut, use_tqdm=False)
    assert out.prompt_token_ids == whole.prompt_token_ids[-3:]
    (same,) = llm.generate({"prompt_token_ids": whole.prompt_token_ids[-3:]}, GREEDY)
    assert out.token_ids == same.token_ids
    # -1: the model's length; a prompt longer than it is cut instead of refused.
    too_long = list(range(10, 10 + llm.engine.max_model_len + 5))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": too_long}, GREEDY, use_tqdm=False)
    to_model = SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=-1)
    (fitted,) = llm.generate({"prompt_token_ids": too_long[:-1]}, to_model, use_tqdm=False)
    assert fitted.prompt_token_ids == too_long[-1 - llm.engine.max_model_len : -1]


def test_bad_words_are_never_generated(llm: LLM, tiny_llama_dir: Path) -> None:
    (free,) = llm.generate(TEXT, GREEDY, use_tqdm=False)
    assert llm.tokenizer is not None
    word = llm.tokenizer.decode(free.token_ids[:1]).strip()
    assert word, "the first greedy token decodes to a word"
    params = SamplingParams(**{**_fields(GREEDY), "bad_words": [word]})
    (out,) = llm.generate(TEXT, params, use_tqdm=False)
    gateway = Tokenizer.from_model_dir(tiny_llama_dir)
    banned = {ids[0] for ids in (gateway.encode_text(word), gateway.encode_text(" " + word))}
    assert free.token_ids[0] in banned  # the ban changes what greedy picks
    assert not banned.intersection(out.token_ids) and len(out.token_ids) == 8
    with pytest.raises(SamplingParamError, match=r"bad_words\[1\] must be a non-empty string"):
        SamplingParams(bad_words=["ok", ""])


def test_structured_outputs_constrain_as_the_gateways_field_does(llm: LLM) -> None:
    choice = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no way"]),
    )
    (picked,) = llm.generate(TEXT, choice, use_tqdm=False)
    assert picked.text in {"yes", "no way"}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    as_json = SamplingParams(
        max_tokens=40,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=schema, disable_additional_properties=True),
    )
    assert as_json.guided is not None
    assert json.loads(as_json.guided.spec)["additionalProperties"] is False
    (out,) = llm.generate(TEXT, as_json, use_tqdm=False)
    if out.finish_reason == "stop":  # a random model may run out of tokens inside the object
        value = json.loads(out.text or "")
        assert set(value) == {"n"} and isinstance(value["n"], int)
    regex = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"),
    )
    (digits,) = llm.generate(TEXT, regex, use_tqdm=False)
    assert re.fullmatch("[0-9]{3}", digits.text or "")


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
        ({}, "structured_outputs"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"choice": "ab"}, "structured_outputs.choice"),
        ({"json_object": False}, "structured_outputs.json_object"),
        ({"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
    ],
)
def test_bad_structured_outputs_are_refused_naming_the_field(
    options: dict[str, Any], param: str
) -> None:
    with pytest.raises(SamplingParamError) as caught:
        SamplingParams(structured_outputs=StructuredOutputsParams(**options))
    assert caught.value.param == param
    assert str(caught.value).startswith(param)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("truncate_prompt_tokens", 0, "must be >= 1 or -1"),
        ("truncate_prompt_tokens", -2, "must be >= -1"),
        ("truncate_prompt_tokens", -1.0, "must be an integer"),
        ("skip_special_tokens", 1, "must be a bool"),
        ("detokenize", None, "must be a bool"),
        ("bad_words", "word", "must be a list of strings"),
    ],
)
def test_text_option_values_are_checked_naming_the_field(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(SamplingParamError, match=message) as caught:
        SamplingParams(**{field: value})
    assert caught.value.param == field


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(llm: LLM) -> None:
    prompt = list(range(300, 340))  # two full blocks of 16 and a tail

    def cached(prompt_form: Any, params: SamplingParams = GREEDY) -> int:
        (out,) = llm.generate(prompt_form, params, use_tqdm=False)
        return out.num_cached_tokens

    salted = SamplingParams(**{**_fields(GREEDY), "cache_salt": "tenant-a"})
    assert cached({"prompt_token_ids": prompt}) == 0
    # vLLM's place for it, the prompt dict, and SamplingParams' field are the same salt.
    assert cached({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}) == 0
    assert cached({"prompt_token_ids": prompt}, salted) == 32
    assert cached({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}) == 0
    assert cached({"prompt_token_ids": prompt}) == 32
    with pytest.raises(SamplingParamError, match="cache_salt") as refused:
        llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, salted)
    assert refused.value.param == "cache_salt"
    with pytest.raises(SamplingParamError, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": ""}, GREEDY)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.beam_search({"prompt": TEXT, "cache_salt": "a"}, BeamSearchParams(2, 2))
    assert llm.engine.stats().num_blocks_used == 0


def test_options_a_node_would_drop_are_refused_at_the_protobuf_edge() -> None:
    for field, value in (("bad_words", ["x"]), ("truncate_prompt_tokens", 4)):
        with pytest.raises(SamplingParamError) as caught:
            sampling_params_to_proto(SamplingParams(**{field: value}))
        assert caught.value.param == field
    message = sampling_params_to_proto(
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    )
    assert message.guided.spec == "[a-z]+"


def _fields(params: SamplingParams) -> dict[str, Any]:
    """``params``' constructor arguments (the derived ``guided`` included)."""
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_get_tokenizer_is_transformers_over_the_same_vocabulary_and_template(
    llm: LLM, tiny_llama_dir: Path
) -> None:
    """vLLM scripts render chats with ``llm.get_tokenizer().apply_chat_template(...)`` and pass
    the text to ``generate``: the same text and ids the gateway's chat API makes."""
    tokenizer = llm.get_tokenizer()
    assert llm.get_tokenizer() is tokenizer
    gateway = Tokenizer.from_model_dir(tiny_llama_dir)
    chat = [{"role": "user", "content": TEXT}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == gateway.apply_chat_template(chat)
    assert tokenizer.encode(TEXT) == gateway.encode(TEXT)
    assert tokenizer.decode(gateway.encode(TEXT), skip_special_tokens=True) == TEXT
    assert tokenizer.eos_token is not None
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    assert eos_id in llm.engine.model_config.eos_token_ids


def test_a_gguf_models_get_tokenizer_carries_the_files_template(tiny_gguf_factory: Any) -> None:
    path = tiny_gguf_factory()
    gateway = Tokenizer.from_model_dir(path)
    tokenizer = small_llm(path).get_tokenizer()
    chat = [{"role": "user", "content": TEXT}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == gateway.apply_chat_template(chat)
    assert tokenizer.encode(TEXT) == gateway.encode(TEXT)


def test_vllms_constructor_names_are_taken(tiny_llama_dir: Path) -> None:
    """``LLM(model=...)`` with vLLM's ``enforce_eager``, ``tensor_parallel_size`` and
    ``trust_remote_code``, as vLLM scripts write it."""
    llm = small_llm(tiny_llama_dir, enforce_eager=True, trust_remote_code=True)
    assert llm.engine.config.cuda_graphs is False
    named = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        max_model_len=64,
        kv_cache_memory=1 << 22,
        tensor_parallel_size=1,
    )
    assert named.generate(TEXT, GREEDY, use_tqdm=False)[0].token_ids
    with pytest.raises(EngineConfigError, match="tensor_parallel_size must be 1"):
        small_llm(tiny_llama_dir, tensor_parallel_size=2)
    with pytest.raises(EngineConfigError, match="contradicts cuda_graphs=True"):
        small_llm(tiny_llama_dir, enforce_eager=True, cuda_graphs=True)
    with pytest.raises(EngineConfigError, match="enforce_eager must be True or False"):
        small_llm(tiny_llama_dir, enforce_eager="yes")
