"""``--chat-template`` (vLLM's flag): a Jinja file, or the template itself, rendered in place of
the model's for every chat input (the OpenAI chat route, ``/tokenize`` with messages, gRPC
chat); a template that does not compile, or cannot render a one-message conversation, stops the
gateway at start-up in one line with exit 2, as a broken model template does."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.__main__ import main
from gateway.config import parse_gateway_config
from gateway.errors import GatewayError
from gateway.text.tokenizer import Tokenizer
from pdserve.v1 import gateway_pb2
from support.fake_gateway import FakeGateway

# Unlike the tiny model's ChatML: a prompt rendered with it is told apart from the model's.
TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi there"}]
RENDERED = "[user] Hi there\n[assistant]"


def _config_template(
    tiny_llama_dir: Path, *flags: str, env: dict[str, str] | None = None
) -> str | None:
    argv = ["--model", str(tiny_llama_dir), "--colocated", "127.0.0.1:1", *flags]
    return parse_gateway_config(argv, env or {}).chat_template


def test_the_value_is_a_file_or_else_the_template_itself(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    template_file = tmp_path / "template.jinja"
    template_file.write_text(TEMPLATE)
    assert _config_template(tiny_llama_dir, "--chat-template", str(template_file)) == TEMPLATE
    # No such file, and Jinja markup in the value: the value is the template (vLLM's rule).
    assert _config_template(tiny_llama_dir, "--chat-template", TEMPLATE) == TEMPLATE
    env = {"PDSERVE_CHAT_TEMPLATE": str(template_file)}
    assert _config_template(tiny_llama_dir, env=env) == TEMPLATE
    assert _config_template(tiny_llama_dir) is None


@pytest.mark.parametrize("value", ["templates/missing.jinja", "template.jinja", ""])
def test_a_missing_file_is_a_flag_error(
    tiny_llama_dir: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _config_template(tiny_llama_dir, "--chat-template", value)
    assert exited.value.code == 2
    assert f"error: --chat-template: cannot read {value!r}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Iterator[FakeGateway]:
    gateway = FakeGateway.start(tiny_llama_dir, extra=["--chat-template", TEMPLATE])
    yield gateway
    gateway.close()


def test_the_flag_overrides_the_model_template_on_every_chat_input(
    served: FakeGateway, tokenizer: Tokenizer
) -> None:
    expected = tokenizer.encode(RENDERED, add_special_tokens=False)
    assert expected != tokenizer.encode_chat(MESSAGES), "the model's own template differs"

    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**MESSAGES[0])])
    code, details, _ = served.call(gateway_pb2.GatewayGenerateRequest(chat=chat))
    assert code is grpc.StatusCode.OK, details
    assert served.node.prompts[-1] == expected

    async def http() -> tuple[httpx.Response, httpx.Response]:
        url = f"http://127.0.0.1:{served.gateway.http_port}"
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
            completion = await client.post("/v1/chat/completions", json=body)
            tokenized = await client.post("/tokenize", json={"messages": MESSAGES})
            return completion, tokenized

    completion, tokenized = served.loop.run_until_complete(http())
    assert completion.status_code == 200, completion.text
    assert served.node.prompts[-1] == expected
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == expected


def _without_template(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    return model_dir


def test_a_model_without_a_template_takes_the_flag_and_refuses_chat_without_it(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = _without_template(tiny_llama_dir, tmp_path)
    plain = Tokenizer.from_model_dir(model_dir)
    with pytest.raises(GatewayError, match="this model has no chat template"):
        plain.apply_chat_template(MESSAGES)  # today's answer: a 400 / INVALID_ARGUMENT
    flagged = Tokenizer.from_model_dir(model_dir, chat_template=TEMPLATE)
    assert flagged.apply_chat_template(MESSAGES) == RENDERED


def test_the_flag_wins_over_a_broken_model_template(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    (model_dir / "chat_template.jinja").write_text("{{ messages }")
    flagged = Tokenizer.from_model_dir(model_dir, chat_template=TEMPLATE)
    assert flagged.apply_chat_template(MESSAGES) == RENDERED


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("{{ messages }", "chat_template is not valid Jinja: unexpected '}' (line 1)"),
        (
            "{{ raise_exception('a system message is required') }}",
            "cannot render a conversation of one user message: "
            "TemplateError: a system message is required",
        ),
        ("{{ messages[0].content | no_such_filter }}", "No filter named 'no_such_filter'"),
        ("{% if false %}x{% endif %}", "renders a conversation of one user message as no text"),
    ],
    ids=["syntax", "raises", "unknown_filter", "empty"],
)
def test_a_broken_flag_template_stops_the_start_in_one_line_with_exit_2(
    tiny_llama_dir: Path, template: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_llama_dir), "--colocated", "127.0.0.1:1", "--host", "127.0.0.1",
            "--http-port", "0", "--grpc-port", "0", "--chat-template", template]  # fmt: skip
    assert asyncio.run(main(argv)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m gateway: error: --chat-template: "), line
    assert problem in line
