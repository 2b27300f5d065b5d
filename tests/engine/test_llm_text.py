"""``LLM.generate`` on text, as vLLM's: prompts encoded and outputs decoded with the model's own
tokenizer, the one the gateway uses (so both give the same ids for the same text).

Each prompt form (a string, token ids, vLLM's ``{"prompt": ...}`` and ``{"prompt_token_ids":
...}``) gives the same tokens for the same text; an output's text leaves out the stop token
that ended it; ``skip_tokenizer_init`` loads no tokenizer and takes token ids only.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.text.tokenizer import Tokenizer
from services.convert import sampling_params_to_proto
from services.engine import LLM, EngineConfigError, FinishReason, SamplingParams
from services.guided_decoding import GuidedDecoding, GuidedKind
from support.small_llm import small_llm

TEXT = "The quick brown fox jumps over"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return small_llm(tiny_llama_dir)


def test_every_prompt_form_gives_the_ids_and_tokens_of_the_gateways_encoding(
    llm: LLM, tiny_llama_dir: Path
) -> None:
    gateway = Tokenizer.from_model_dir(tiny_llama_dir)
    ids = gateway.encode(TEXT)
    outputs = llm.generate(
        [TEXT, ids, {"prompt": TEXT}, {"prompt_token_ids": ids}, "another prompt"], GREEDY
    )
    assert [out.prompt_token_ids for out in outputs[:4]] == [ids] * 4
    assert outputs[4].prompt_token_ids == gateway.encode("another prompt")
    assert len({tuple(out.token_ids) for out in outputs[:4]}) == 1
    assert [out.prompt for out in outputs] == [TEXT, None, TEXT, None, "another prompt"]
    for out in outputs:
        assert out.text == gateway.decode(out.token_ids)
        assert out.text  # eight tokens of a random model decode to something


def test_one_string_alone_is_one_prompt(llm: LLM) -> None:
    (output,) = llm.generate(TEXT, GREEDY)
    assert output.prompt == TEXT
    assert len(output.token_ids) == GREEDY.max_tokens


def test_the_stop_token_that_ended_an_output_is_not_in_its_text(
    llm: LLM, tiny_llama_dir: Path
) -> None:
    gateway = Tokenizer.from_model_dir(tiny_llama_dir)
    (free,) = llm.generate(TEXT, GREEDY)
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    params = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]
    )
    (stopped,) = llm.generate(TEXT, params)
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.text == gateway.decode(free.token_ids[:first])
    assert stopped.stop_reason == stop_id  # vLLM's: the stop token id
    # Cut by max_tokens instead, the last token's text stays.
    assert free.finish_reason is FinishReason.LENGTH
    assert free.text == gateway.decode(free.token_ids)
    assert free.stop_reason is None
    # include_stop_str_in_output keeps the stop token's text, as vLLM's.
    kept = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id],
        include_stop_str_in_output=True,
    )  # fmt: skip
    (with_stop,) = llm.generate(TEXT, kept)
    assert with_stop.text == gateway.decode(free.token_ids[: first + 1])


LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def token_texts(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    """Where each token's text ends in the decoded output: the text of each prefix."""
    return [tokenizer.decode(token_ids[: i + 1]) for i in range(len(token_ids))]


def test_a_stop_string_ends_the_text_where_it_first_appears(llm: LLM, tiny_llama_dir: Path) -> None:
    """vLLM's ``stop``: the text ends before the string (after it with
    ``include_stop_str_in_output``), the request ends ``stop`` with the string as its
    ``stop_reason``, and its tokens end with the one that completed the string, even when the
    string spans tokens; the engine stops generating it there."""
    gateway = Tokenizer.from_model_dir(tiny_llama_dir)
    (free,) = llm.generate(TEXT, LONG)
    prefixes = token_texts(gateway, free.token_ids)
    assert prefixes[-1] == free.text and len(free.text) > 12
    # A string from the middle of token 5's text into token 6's: it spans a token boundary.
    cut = len(prefixes[4])
    stop = free.text[cut - 2 : cut + 2]
    begin = free.text.find(stop)  # where it first appears (maybe earlier than `cut - 2`)
    completing = next(i for i, prefix in enumerate(prefixes) if len(prefix) >= begin + len(stop))

    (stopped,) = llm.generate(TEXT, replace(LONG, stop=(stop,)))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.stop_reason == stop
    assert stopped.text == free.text[:begin]
    assert stopped.token_ids == free.token_ids[: completing + 1]
    assert stopped.outputs[0].stop_reason == stop and stopped.outputs[0].text == stopped.text

    (kept,) = llm.generate(TEXT, replace(LONG, stop=stop, include_stop_str_in_output=True))
    assert kept.text == free.text[: begin + len(stop)]
    assert kept.stop_reason == stop

    # Of two stops the one that ends first wins, whichever is listed first; one that never
    # appears changes nothing.
    later = free.text[begin + len(stop) : begin + len(stop) + 3]
    assert later and free.text.find(later) >= begin
    (first,) = llm.generate(TEXT, replace(LONG, stop=[later, "never in it \x00", stop]))
    assert first.stop_reason == stop and first.text == stopped.text
    (absent,) = llm.generate(TEXT, replace(LONG, stop=["never in it \x00"]))
    assert absent.finish_reason is FinishReason.LENGTH and absent.text == free.text
    assert absent.stop_reason is None

    # A batch: each request ends on its own stop; the engine holds no request afterwards.
    outputs = llm.generate([TEXT, TEXT], [replace(LONG, stop=stop), LONG])
    assert [out.text for out in outputs] == [stopped.text, free.text]
    stats = llm.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks_used == 0


def test_stop_strings_are_checked(tiny_llama_dir: Path) -> None:
    refused = [("", "non-empty"), ([""], "non-empty"), ([3], "non-empty strings"),
               (5, "a string or a list")]  # fmt: skip
    for stop, message in refused:
        with pytest.raises(ValueError, match=message) as refusal:
            SamplingParams(stop=stop)
        assert refusal.value.param == "stop"  # type: ignore[attr-defined]
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop=["a", "b", "a"]).stop == ("a", "b")
    with pytest.raises(ValueError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(include_stop_str_in_output=1)  # type: ignore[arg-type]
    # Text stops need the text; a node never sees them.
    llm = small_llm(tiny_llama_dir, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[5, 6, 7]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="the gateway takes them"):
        sampling_params_to_proto(SamplingParams(stop=["x"]))


def test_a_gguf_models_text_goes_through_the_tokenizer_its_file_carries(
    tiny_gguf_factory,
) -> None:
    path = tiny_gguf_factory()
    gateway = Tokenizer.from_model_dir(path)
    (output,) = small_llm(path).generate(TEXT, GREEDY)
    assert output.prompt_token_ids == gateway.encode(TEXT)
    assert output.text == gateway.decode(output.token_ids)


def test_skip_tokenizer_init_takes_token_ids_and_gives_no_text(tiny_llama_dir: Path) -> None:
    llm = small_llm(tiny_llama_dir, skip_tokenizer_init=True)
    assert llm.tokenizer is None
    (output,) = llm.generate([[5, 6, 7]], GREEDY)
    assert output.text is None and len(output.token_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match=r"skip_tokenizer_init=True\) does not load"):
        llm.generate(TEXT, GREEDY)


def test_a_model_without_a_tokenizer_is_refused_unless_skipped(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    (model_dir / "tokenizer.json").unlink()
    refusal = (
        r"text in and out of LLM\.generate needs the model's tokenizer \(.*tokenizer\.json not "
        r"found.*skip_tokenizer_init=True\) loads none"
    )
    with pytest.raises(EngineConfigError, match=refusal):
        small_llm(model_dir)
    assert small_llm(model_dir, skip_tokenizer_init=True).generate([[5]], GREEDY)[0].text is None


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([{"prompt": 5}], r'prompt 0: "prompt" must be a string'),
        ([{"prompt": TEXT, "images": []}], r"keys \['images', 'prompt'\]"),
        ([b"bytes"], r"prompt 0 is bytes"),
        (b"bytes", r"prompts must be a string or a list of prompts"),
        (5, r"got int"),
    ],
)
def test_malformed_prompts_are_refused_naming_which(
    llm: LLM, prompts: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY)  # type: ignore[arg-type]


def test_skip_tokenizer_init_must_be_a_bool(tiny_llama_dir: Path) -> None:
    with pytest.raises(EngineConfigError, match="skip_tokenizer_init must be True or False"):
        small_llm(tiny_llama_dir, skip_tokenizer_init="no")


def test_outputs_come_in_vllms_shape_too(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    (out,) = llm.generate(TEXT, params)
    (completion,) = out.outputs
    assert completion.index == 0
    assert completion.text == out.text and completion.text
    assert completion.token_ids == out.token_ids and len(completion.token_ids) == 6
    assert completion.finish_reason == "length" and completion.finished
    assert completion.logprobs == out.logprobs
    assert out.logprobs is not None
    sampled = [step[token].logprob for step, token in zip(out.logprobs, out.token_ids, strict=True)]
    assert completion.cumulative_logprob == pytest.approx(sum(sampled))
    assert completion.cumulative_logprob < 0
    (plain,) = llm.generate(TEXT, GREEDY)
    assert plain.outputs[0].cumulative_logprob is None
    assert plain.outputs[0].logprobs is None


def test_a_grammar_that_fails_while_running_says_why(llm: LLM) -> None:
    # The node's compile drives a grammar over its first token only; this one fails once the
    # rule of 2,001 alternatives is predicted, after sixteen "q" (logit_bias makes greedy take
    # them one at a time).
    wide = " | ".join(f'"label{i}"' for i in range(2_001))
    guided = GuidedDecoding(GuidedKind.GRAMMAR, f'start: "{"q" * 16}" wide | "a"\nwide: {wide}')
    assert llm.tokenizer is not None
    (q_token,) = llm.tokenizer.encode("q", add_special_tokens=False).ids
    params = SamplingParams(
        max_tokens=30, temperature=0.0, guided=guided, logit_bias=((q_token, 100.0),)
    )
    (out,) = llm.generate(TEXT, params)
    assert out.finish_reason is FinishReason.ERROR
    assert out.error is not None and "guided.grammar" in out.error
    assert out.outputs[0].finish_reason == "error"


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]


def test_chat_renders_as_the_gateway_and_generates_as_generate(
    llm: LLM, tiny_llama_dir: Path
) -> None:
    """vLLM's ``LLM.chat``: the model's template renders each conversation to the very prompt
    the gateway's chat API would send (no BOS added on top of the template's), and the tokens
    are what ``generate`` gives for those ids."""
    gateway = Tokenizer.from_model_dir(tiny_llama_dir)
    ids = gateway.encode_chat(CHAT)
    (out,) = llm.chat(CHAT, GREEDY)
    assert out.prompt_token_ids == ids
    assert out.prompt == gateway.apply_chat_template(CHAT)
    assert out.prompt.endswith("<|im_start|>assistant\n")
    (same,) = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert out.token_ids == same.token_ids and out.text == same.text

    # Several conversations, each with its own params; without the generation prompt, and
    # continuing the final message.
    second = [{"role": "user", "content": "another prompt"}]
    outputs = llm.chat([CHAT, second], [GREEDY, replace(GREEDY, max_tokens=3)])
    assert [out.prompt_token_ids for out in outputs] == [ids, gateway.encode_chat(second)]
    assert [len(out.token_ids) for out in outputs] == [8, 3]
    (bare,) = llm.chat(CHAT, GREEDY, add_generation_prompt=False)
    assert bare.prompt == gateway.apply_chat_template(CHAT, add_generation_prompt=False)
    partial = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    (cont,) = llm.chat(partial, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt is not None and cont.prompt.endswith("The answer is")

    # A template of the caller's, with the model's special tokens and the caller's variables.
    template = "{{ bos_token }}[{{ greeting }}]{% for m in messages %}{{ m.content }}{% endfor %}"
    (custom,) = llm.chat(
        CHAT, GREEDY, chat_template=template, chat_template_kwargs={"greeting": "hey"}
    )
    assert custom.prompt == gateway.special_tokens["bos_token"] + "[hey]Be brief." + TEXT


def test_chat_refuses_what_it_cannot_render(llm: LLM, tiny_llama_dir: Path) -> None:
    stats = llm.engine.stats()
    refused = [
        ([{"role": "robot", "content": "x"}], "messages\\[0\\].role"),
        ([{"role": "user"}], "messages\\[0\\].content"),
        ([], "non-empty"),
        ("hello", "list of message dicts"),
        ([CHAT, "x"], "messages\\[1\\] must be a conversation"),
        ([CHAT, [{"role": "robot", "content": "x"}]], "conversation 1: messages\\[0\\].role"),
    ]
    for messages, match in refused:
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, GREEDY)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rejected the messages"):
        llm.chat(CHAT, GREEDY, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="not valid Jinja"):
        llm.chat(CHAT, GREEDY, chat_template="{% for %}")
    assert llm.engine.stats().num_waiting == stats.num_waiting == 0  # nothing queued
    no_text = small_llm(tiny_llama_dir, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        no_text.chat(CHAT, GREEDY)


def test_chat_without_a_template_says_how_to_go_on(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    llm = small_llm(model_dir)
    with pytest.raises(ValueError, match=r"no chat template \(.*tokenizer_config\.json holds"):
        llm.chat(CHAT, GREEDY)
    # A template of the caller's still works, and then the model's is still missing.
    (out,) = llm.chat(
        CHAT, GREEDY, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert out.prompt == "Be brief." + TEXT
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(CHAT, GREEDY)
    # A model's own template that does not compile names the file to fix.
    config["chat_template"] = "{% for %}"
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template is not valid"):
        small_llm(model_dir).chat(CHAT, GREEDY)


def test_n_samples_of_a_prompt_come_back_as_one_outputs_outputs(llm: LLM) -> None:
    """vLLM's ``n``: one output a prompt, ``outputs`` its n samples; with a seed, sample j is
    what a request seeded seed + j gives (so they differ, and each is reproducible)."""
    sampled = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, seed=11, n=3)
    first, second = llm.generate([TEXT, "another prompt"], [sampled, replace(sampled, n=1)])
    assert [len(first.outputs), len(second.outputs)] == [3, 1]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert first.outputs[0].token_ids == first.token_ids and first.outputs[0].text == first.text
    alone = [llm.generate(TEXT, replace(sampled, n=1, seed=11 + j))[0] for j in range(3)]
    assert [c.token_ids for c in first.outputs] == [out.token_ids for out in alone]
    assert [c.text for c in first.outputs] == [out.text for out in alone]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # the seeds differ
    assert all(c.finish_reason == "length" for c in first.outputs)
    # Each sample ends on its own stop; the engine holds nothing afterwards.
    stop = first.outputs[1].text[1:3]
    (stopped,) = llm.generate(TEXT, replace(sampled, stop=[stop]))
    assert stopped.outputs[1].stop_reason == stop
    assert stopped.outputs[1].text == first.outputs[1].text[: first.outputs[1].text.find(stop)]
    assert llm.engine.stats().num_blocks_used == 0
    # n is checked, and a node never receives it.
    for n in (0, 1025, 1.5):
        with pytest.raises(ValueError, match="n must be"):
            SamplingParams(n=n)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one sample a request"):
        sampling_params_to_proto(SamplingParams(n=2))
