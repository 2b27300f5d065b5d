"""The gateway's torch-free tokenizer against ``transformers.AutoTokenizer`` on the same files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.errors import ErrorKind, GatewayError
from gateway.text.tokenizer import Tokenizer
from services.models import ModelFileError

TEXTS = (
    "Hello world",
    "  leading spaces and trailing  ",
    "café über naïve 日本語 東京 😀🚀 漢字 ÿ",
    "line one\nline two\r\n\ttabbed",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "",
)

CONVERSATIONS: tuple[list[dict[str, Any]], ...] = (
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2? 😀"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "日本語で"},
    ],
)

# Uses every helper transformers gives templates; rendered by both implementations.
FEATURE_TEMPLATE = """\
{%- set ns = namespace(count=0) -%}
{{ bos_token }}
{% for message in messages %}
    {%- if message['role'] == 'tool' %}{% continue %}{% endif -%}
    {%- set ns.count = ns.count + 1 -%}
    {%- if message['role'] == 'assistant' -%}
        {% generation %}A: {{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {%- else -%}
        {{ message['role'] | upper }}: {{ message['content'] }}
    {%- endif %}

{% endfor %}
{% if tools %}TOOLS {{ tools | tojson }}
{% endif %}
{{ dict(n=ns.count) | tojson }} {{ {'html': '<b>é</b>'} | tojson(indent=1) }}
{% if strftime_now('%Y') | length != 4 %}{{ raise_exception('bad year') }}{% endif %}
{% if add_generation_prompt %}A:{% endif %}"""

ALTERNATING_TEMPLATE = """\
{% for message in messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{{ message['role'] }}: {{ message['content'] }}
{% endfor %}"""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

ModelDirFactory = Callable[..., Path]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture
def make_model_dir(tiny_llama_dir: Path, tmp_path: Path) -> ModelDirFactory:
    """``make(template_file=None, **config_changes)``: the tiny tokenizer with edited config.

    A config value of None removes that key.
    """

    def make(template_file: str | None = None, **config_changes: Any) -> Path:
        out_dir = tmp_path / "model"
        out_dir.mkdir()
        for name in TOKENIZER_FILES:
            shutil.copy(tiny_llama_dir / name, out_dir / name)
        config = json.loads((out_dir / "tokenizer_config.json").read_text())
        for key, value in config_changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
        if template_file is not None:
            (out_dir / "chat_template.jinja").write_text(template_file)
        return out_dir

    return make


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(
    tokenizer: Tokenizer,
    hf_tokenizer: PreTrainedTokenizerBase,
    text: str,
    add_special_tokens: bool,
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert (ids[:1] == [hf_tokenizer.bos_token_id]) == add_special_tokens


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(
    tokenizer: Tokenizer,
    hf_tokenizer: PreTrainedTokenizerBase,
    text: str,
    skip_special_tokens: bool,
) -> None:
    ids = hf_tokenizer.encode(text)
    decoded = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert decoded == hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if skip_special_tokens:
        assert decoded == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_vocab_and_special_tokens(
    tokenizer: Tokenizer, hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    assert tokenizer.vocab_size == len(hf_tokenizer)
    assert tokenizer.eos_token_ids == (hf_tokenizer.eos_token_id,)
    assert tokenizer.special_tokens == hf_tokenizer.special_tokens_map


def test_eos_ids_include_generation_config(make_model_dir: ModelDirFactory) -> None:
    model_dir = make_model_dir()
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))
    # The tokenizer's own EOS first, then the generation config's others, each once.
    assert Tokenizer.from_model_dir(model_dir).eos_token_ids == (1, 3)


def test_token_text_matches_vllm_logprob_text(
    tokenizer: Tokenizer, hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    # vLLM shows each logprob token as decode([id]) with special tokens kept.
    for token_id in range(tokenizer.vocab_size):
        assert tokenizer.token_text(token_id) == hf_tokenizer.decode([token_id]), token_id


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_utf8(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(token_id) for token_id in ids) == text.encode()


def test_token_bytes_of_a_split_character(tokenizer: Tokenizer) -> None:
    # A rare CJK character stays split across byte tokens in the tiny vocabulary.
    ids = tokenizer.encode("鿋", add_special_tokens=False)
    assert len(ids) > 1
    assert all(tokenizer.token_text(token_id) == "\ufffd" for token_id in ids)
    assert [tokenizer.token_bytes(token_id) for token_id in ids] == [
        bytes([byte]) for byte in "鿋".encode()
    ]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer,
    hf_tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    rendered = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt
    )
    assert rendered == hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert rendered.startswith("<|begin_of_text|><|im_start|>")
    assert rendered.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_encode_chat_has_one_bos(
    tokenizer: Tokenizer,
    hf_tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
) -> None:
    ids = tokenizer.encode_chat(conversation)
    expected = hf_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, return_dict=False
    )
    assert ids == expected
    assert ids.count(hf_tokenizer.bos_token_id) == 1


def test_template_helpers_match_transformers(make_model_dir: ModelDirFactory) -> None:
    # chat_template.jinja overrides the config's template, as in transformers 5.
    model_dir = make_model_dir(template_file=FEATURE_TEMPLATE)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversation = [
        *CONVERSATIONS[1],
        {"role": "tool", "content": "skipped"},
        {"role": "assistant", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "<é>"}}]
    for kwargs in ({}, {"tools": tools}):
        rendered = tokenizer.apply_chat_template(conversation, **kwargs)
        assert rendered == hf_tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert '{"n": 5}' in rendered
        assert '"<b>é</b>"' in rendered  # tojson neither escapes HTML nor non-ASCII
        assert ("TOOLS" in rendered) == bool(kwargs)


def test_named_templates_use_the_default(make_model_dir: ModelDirFactory) -> None:
    templates = [
        {"name": "default", "template": "D{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T"},
    ]
    tokenizer = Tokenizer.from_model_dir(make_model_dir(chat_template=templates))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"


def test_content_parts_join_with_newlines(tokenizer: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    with_parts = tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    as_string = tokenizer.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert with_parts == as_string


def test_none_fields_are_dropped(tokenizer: Tokenizer) -> None:
    # OpenAI clients send "name": null; a template sees the key as missing, as in transformers.
    message = {"role": "user", "content": "hi", "name": None}
    rendered = tokenizer.apply_chat_template([message])
    assert rendered == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "fragment", "param"),
    [
        ([], "non-empty list", "messages"),
        ("hello", "non-empty list", "messages"),
        (["hello"], "messages[0] must be an object", "messages[0]"),
        ([{"content": "hi"}], "None is not one of", "messages[0].role"),
        (
            [{"role": "wizard", "content": "hi"}],
            "messages[0].role: 'wizard' is not one of system, developer, user, assistant, tool",
            "messages[0].role",
        ),
        # OpenAI's deprecated role: refused by the OpenAI bridge's model, and so here.
        ([{"role": "function", "content": "hi"}], "'function' is not one of", "messages[0].role"),
        ([{"role": "user", "content": 42}], "got int", "messages[0].content"),
        ([{"role": "user"}], "a user message needs content", "messages[0].content"),
        ([{"role": "user", "content": {"text": "hi"}}], "got dict", "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "'image_url'",
            "messages[0].content[0].type",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            "text must be a string",
            "messages[0].content[0].text",
        ),
        ([{"role": "user", "content": ["plain string part"]}], "'str'", "messages[0].content[0]"),
    ],
)
def test_bad_messages_are_invalid_argument(
    tokenizer: Tokenizer, messages: Any, fragment: str, param: str
) -> None:
    with pytest.raises(GatewayError) as raised:
        tokenizer.apply_chat_template(messages)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT
    assert raised.value.param == param
    assert fragment in raised.value.message


def test_template_refusal_is_invalid_argument(make_model_dir: ModelDirFactory) -> None:
    tokenizer = Tokenizer.from_model_dir(make_model_dir(template_file=ALTERNATING_TEMPLATE))
    ok = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert tokenizer.apply_chat_template(ok) == "user: a\nassistant: b\n"
    with pytest.raises(GatewayError) as raised:
        tokenizer.encode_chat([{"role": "assistant", "content": "b"}])
    assert raised.value.param == "messages"
    assert "must alternate" in raised.value.message


# Iterates over each call's arguments as a mapping, as tool-use templates do.
ITEMS_TEMPLATE = """\
{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}
{% for call in message.tool_calls or [] %}{{ call.function.name }}(\
{% for key, value in call.function.arguments|items %}{{ key }}={{ value }};{% endfor %})
{% endfor %}{% endfor %}"""


def _with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tokenizer.backend, tokenizer.special_tokens, (), template)


def test_an_assistant_tool_call_reaches_the_template_as_vllm_passes_it(
    tokenizer: Tokenizer,
) -> None:
    # What the OpenAI SDK replays: content null, arguments as JSON text. vLLM renders the
    # content as "" and parses the arguments (not JSON: {}); an empty list is dropped.
    as_json = _with_template(tokenizer, "{{ messages | tojson }}")

    def call(arguments: object) -> dict[str, Any]:
        return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}

    given = [call('{"city": "Oslo", "days": [1, 2]}'), call("not json"), call(None), call("[3]")]
    conversation = [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": None, "tool_calls": given},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "done", "tool_calls": []},
    ]
    rendered = json.loads(as_json.apply_chat_template(conversation, add_generation_prompt=False))
    assert rendered[1]["content"] == ""
    assert [c["function"]["arguments"] for c in rendered[1]["tool_calls"]] == [
        {"city": "Oslo", "days": [1, 2]}, {}, {}, [3],
    ]  # fmt: skip
    assert rendered[1]["tool_calls"][0]["id"] == "c1"
    assert rendered[3] == {"role": "assistant", "content": "done"}
    assert given[0]["function"]["arguments"] == '{"city": "Oslo", "days": [1, 2]}', "not mutated"

    # A template that iterates the arguments as a mapping gets one; the JSON text would fail it.
    items = _with_template(tokenizer, ITEMS_TEMPLATE)
    replay = [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Oslo", "n": 2}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    text = items.apply_chat_template(replay, add_generation_prompt=False)
    assert text == "user: call f\nassistant: \nf(city=Oslo;n=2;)\ntool: 42\n"


@pytest.mark.parametrize(
    ("tool_calls", "fragment"),
    [
        ("f", "tool_calls must be a list"),
        (["f"], "tool_calls[0] needs a 'function'"),
        ([{"id": "c1", "function": {"arguments": "{}"}}], "tool_calls[0] needs a 'function'"),
    ],
)
def test_malformed_tool_calls_are_invalid_argument(
    tokenizer: Tokenizer, tool_calls: object, fragment: str
) -> None:
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
    ]
    with pytest.raises(GatewayError) as raised:
        tokenizer.apply_chat_template(conversation)
    assert raised.value.param == f"messages[1].{fragment.split()[0]}"
    assert f"messages[1].{fragment}" in raised.value.message


def test_a_template_failing_in_python_is_invalid_argument(tokenizer: Tokenizer) -> None:
    # Not a jinja2 error: a TypeError from the client's values (arguments that are no mapping).
    items = _with_template(tokenizer, ITEMS_TEMPLATE)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
    with pytest.raises(GatewayError) as raised:
        items.apply_chat_template([{"role": "assistant", "tool_calls": [call]}])
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT and raised.value.param == "messages"
    assert "TypeError" in raised.value.message


@pytest.mark.parametrize(
    "conversation",
    [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Trailing  "}],
        [{"role": "user", "content": "Complete: once upon"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
    ],
)
def test_continue_final_message_equals_transformers(
    tokenizer: Tokenizer, hf_tokenizer: PreTrainedTokenizerBase, conversation: list[Any]
) -> None:
    expected = hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, continue_final_message=True
    )
    rendered = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered == expected
    assert rendered.endswith(conversation[-1]["content"]), "no end of turn after the message"
    ids = tokenizer.encode_chat(
        conversation, add_generation_prompt=False, continue_final_message=True
    )
    assert ids == tokenizer.encode(expected, add_special_tokens=False)


def test_continue_final_message_refusals(tokenizer: Tokenizer) -> None:
    conversation = [{"role": "assistant", "content": "x"}]
    with pytest.raises(GatewayError) as raised:
        tokenizer.apply_chat_template(conversation, continue_final_message=True)
    assert raised.value.param == "continue_final_message"
    # A template that does not write the final message out cannot have it continued.
    dropping = _with_template(tokenizer, "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}")
    with pytest.raises(GatewayError) as raised:
        dropping.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            add_generation_prompt=False,
            continue_final_message=True,
        )
    assert raised.value.param == "continue_final_message"


def test_no_chat_template_is_invalid_argument(make_model_dir: ModelDirFactory) -> None:
    tokenizer = Tokenizer.from_model_dir(make_model_dir(chat_template=None))
    assert not tokenizer.has_chat_template
    with pytest.raises(GatewayError) as raised:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert raised.value.param == "messages"
    assert "no chat template" in raised.value.message


@pytest.mark.parametrize("add_bos_token", [True, False])
def test_bos_comes_from_tokenizer_json(
    make_model_dir: ModelDirFactory, add_bos_token: bool
) -> None:
    # transformers 5 keeps tokenizer.json's post-processor whatever the config's flag says.
    model_dir = make_model_dir(add_bos_token=add_bos_token, add_eos_token=True)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode("Hello world")
    assert ids == hf_tokenizer.encode("Hello world")
    assert ids == [hf_tokenizer.bos_token_id, *tokenizer.encode("Hello world", False)]


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def _with_chat_template(model_dir: Path, tmp_path: Path, template: str) -> Path:
    copy = Path(shutil.copytree(model_dir, tmp_path / "model"))
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return copy


def test_a_chat_template_that_is_not_jinja_names_the_file(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = _with_chat_template(tiny_llama_dir, tmp_path, "{% for m in messages %}{{ m }")
    pattern = r"tokenizer_config\.json: chat_template is not valid Jinja: unexpected '}' \(line 1\)"
    with pytest.raises(ModelFileError, match=pattern):
        Tokenizer.from_model_dir(model_dir)


def test_the_gateway_refuses_a_broken_chat_template_in_one_line_with_exit_2(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = _with_chat_template(tiny_llama_dir, tmp_path, "{{ messages }")
    argv = [sys.executable, "-m", "gateway", "--colocated", "127.0.0.1:59999",
            "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
            "--model", str(model_dir)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"python -m gateway: error: --model: {model_dir}/tokenizer_config.json: "
        "chat_template is not valid Jinja: unexpected '}' (line 1)"
    ]
