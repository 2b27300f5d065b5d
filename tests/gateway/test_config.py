"""The gateway's flags and their ``PDSERVE_*`` fallbacks, parsed into ``GatewayConfig``."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import CorsConfig, GatewayConfig, parse_gateway_config


def parse(tiny_llama_dir: Path, *flags: str, **environ: str) -> GatewayConfig:
    return parse_gateway_config(
        ["--model", str(tiny_llama_dir), "--colocated", "127.0.0.1:50081", *flags], environ
    )


def test_client_send_timeout_from_flag_env_or_default(tiny_llama_dir: Path) -> None:
    assert parse(tiny_llama_dir).client_send_timeout_s == 30.0
    assert parse(tiny_llama_dir, "--client-send-timeout-s", "0.5").client_send_timeout_s == 0.5
    from_env = parse(tiny_llama_dir, PDSERVE_CLIENT_SEND_TIMEOUT_S="2")
    assert from_env.client_send_timeout_s == 2.0
    assert parse(tiny_llama_dir, "--client-send-timeout-s", "0").client_send_timeout_s is None
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--client-send-timeout-s", "-1")


def test_runtime_lora_updating_from_flag_env_or_default(tiny_llama_dir: Path) -> None:
    assert not parse(tiny_llama_dir).allow_runtime_lora_updating
    assert parse(tiny_llama_dir, "--allow-runtime-lora-updating").allow_runtime_lora_updating
    env = parse(tiny_llama_dir, PDSERVE_ALLOW_RUNTIME_LORA_UPDATING="1")
    assert env.allow_runtime_lora_updating


def test_local_prefill_max_tokens_from_flag_env_or_default(tiny_llama_dir, capsys) -> None:
    assert parse(tiny_llama_dir).router.local_prefill_max_tokens == 0
    flag = parse(tiny_llama_dir, "--local-prefill-max-tokens", "128")
    assert flag.router.local_prefill_max_tokens == 128
    from_env = parse(tiny_llama_dir, PDSERVE_LOCAL_PREFILL_MAX_TOKENS="64")
    assert from_env.router.local_prefill_max_tokens == 64
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--local-prefill-max-tokens", "-1")
    assert "--local-prefill-max-tokens must be >= 0, got -1" in capsys.readouterr().err


def test_reasoning_parser_from_flag_env_or_default(tiny_llama_dir: Path, capsys) -> None:
    assert parse(tiny_llama_dir).reasoning_parser is None
    assert parse(tiny_llama_dir, "--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
    from_env = parse(tiny_llama_dir, PDSERVE_REASONING_PARSER="deepseek_r1")
    assert from_env.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--reasoning-parser", "o1")
    assert "invalid choice: 'o1'" in capsys.readouterr().err


def test_tool_call_parser_from_flag_env_or_default(tiny_llama_dir: Path, capsys) -> None:
    assert parse(tiny_llama_dir).tool_call_parser is None  # auto: the vocabulary's family
    assert parse(tiny_llama_dir, "--tool-call-parser", "auto").tool_call_parser is None
    flag = parse(tiny_llama_dir, "--tool-call-parser", "pythonic")
    assert flag.tool_call_parser == "pythonic"
    from_env = parse(tiny_llama_dir, PDSERVE_TOOL_CALL_PARSER="llama3_json")
    assert from_env.tool_call_parser == "llama3_json"
    # vLLM's command lines pair it with --enable-auto-tool-choice, which changes nothing here.
    vllm = parse(tiny_llama_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert vllm.tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--tool-call-parser", "granite")
    assert "invalid choice: 'granite'" in capsys.readouterr().err


def test_served_model_names_from_flag_env_or_default(tiny_llama_dir: Path, capsys) -> None:
    default = parse(tiny_llama_dir)
    assert (default.served_model_name, default.served_model_aliases) == (tiny_llama_dir.name, ())
    several = parse(tiny_llama_dir, "--served-model-name", "tiny", "gpt-4o-mini")
    assert (several.served_model_name, several.served_model_aliases) == ("tiny", ("gpt-4o-mini",))
    from_env = parse(tiny_llama_dir, PDSERVE_SERVED_MODEL_NAME="tiny, alias")
    assert (from_env.served_model_name, from_env.served_model_aliases) == ("tiny", ("alias",))
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--served-model-name", "tiny", "tiny")
    assert "distinct" in capsys.readouterr().err


def test_cors_flags_from_flag_env_or_default(tiny_llama_dir: Path, capsys) -> None:
    default = parse(tiny_llama_dir).cors
    assert default == CorsConfig(("*",), ("*",), ("*",), allow_credentials=False)  # vLLM's
    flags = parse(
        tiny_llama_dir,
        "--allowed-origins", '["https://a.example", "https://b.example"]',
        "--allowed-methods", "GET,POST",
        "--allowed-headers", '["Authorization"]',
        "--allow-credentials",
    ).cors  # fmt: skip
    assert flags == CorsConfig(
        ("https://a.example", "https://b.example"), ("GET", "POST"), ("Authorization",), True
    )
    from_env = parse(
        tiny_llama_dir,
        PDSERVE_ALLOWED_ORIGINS="https://a.example, https://b.example",
        PDSERVE_ALLOW_CREDENTIALS="1",
    ).cors
    assert from_env.allowed_origins == ("https://a.example", "https://b.example")
    assert from_env.allow_credentials
    for bad in ('["https://a.example"', '["a", 1]', '[["a"]]'):
        with pytest.raises(SystemExit):
            parse(tiny_llama_dir, "--allowed-origins", bad)
        assert "--allowed-origins" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--allowed-headers", '["Authorization", " "]')
    assert "allowed_headers must be non-empty strings" in capsys.readouterr().err


def test_api_key_env_is_one_key(tiny_llama_dir: Path) -> None:
    # PDSERVE_API_KEY is --api-key given once, never one key per character.
    assert parse(tiny_llama_dir, PDSERVE_API_KEY="sk-abc").api_keys == ("sk-abc",)
    flags = parse(tiny_llama_dir, "--api-key", "k1", "--api-key", "k2", PDSERVE_API_KEY="sk-abc")
    assert flags.api_keys == ("k1", "k2")
    listed = parse(tiny_llama_dir, PDSERVE_API_KEYS="k1, k2")
    assert listed.api_keys == ("k1", "k2")


@pytest.mark.parametrize(
    ("flags", "environ", "named"),
    [
        (("--api-key", ""), {}, "argument --api-key"),
        (("--api-key", "k1", "--api-key", "  "), {}, "argument --api-key"),
        ((), {"PDSERVE_API_KEY": ""}, "PDSERVE_API_KEY (for --api-key)"),
        ((), {"PDSERVE_API_KEYS": " , "}, "PDSERVE_API_KEYS"),
        ((), {"PDSERVE_API_KEYS": ""}, "PDSERVE_API_KEYS"),
    ],
)
def test_empty_api_key_is_refused_not_auth_off(
    tiny_llama_dir: Path, capsys, flags: tuple[str, ...], environ: dict[str, str], named: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(tiny_llama_dir, *flags, **environ)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_api_key_with_spaces_is_refused_without_showing_it(tiny_llama_dir: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--api-key", " sk-secret-77 ")
    err = capsys.readouterr().err
    assert "argument --api-key" in err and "sk-secret-77" not in err


@pytest.mark.parametrize(
    "flag",
    ["--health-interval-s", "--request-timeout-s", "--client-send-timeout-s",
     "--body-read-timeout-s"],
)  # fmt: skip
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_float_flags_must_be_finite(tiny_llama_dir: Path, capsys, flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(tiny_llama_dir, f"{flag}={value}")  # "-inf" alone reads as a flag
    assert exit_.value.code == 2
    assert f"argument {flag}: must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [("--max-body-bytes", "-1MiB"), ("--max-body-bytes=-1MiB",)])
def test_a_negative_max_body_bytes_is_refused_as_one(tiny_llama_dir: Path, capsys, argv) -> None:
    # argparse alone reads "-1MiB" after the flag as another flag ("expected one argument").
    with pytest.raises(SystemExit) as exit_:
        parse(tiny_llama_dir, *argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-body-bytes: byte size must be > 0, got '-1MiB'" in err, err


def test_health_interval_must_be_positive(tiny_llama_dir: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--health-interval-s", "0")
    assert "--health-interval-s must be > 0, got 0.0" in capsys.readouterr().err


def test_lease_ms_fits_the_proto_uint32(tiny_llama_dir: Path, capsys) -> None:
    assert parse(tiny_llama_dir, "--lease-ms", str(2**32 - 1)).router.lease_ms == 2**32 - 1
    for bad in (str(2**32), "5000000000", "99"):
        with pytest.raises(SystemExit) as exit_:
            parse(tiny_llama_dir, "--lease-ms", bad)
        assert exit_.value.code == 2
        assert f"--lease-ms must be in [100, 4294967295], got {bad}" in capsys.readouterr().err


def test_max_model_len_above_the_model_is_refused(tiny_llama_dir: Path, capsys) -> None:
    from gateway.config import model_max_len

    limit = model_max_len(tiny_llama_dir)
    assert parse(tiny_llama_dir, "--max-model-len", str(limit)).limits.max_model_len == limit
    with pytest.raises(SystemExit) as exit_:
        parse(tiny_llama_dir, "--max-model-len", str(limit + 1))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    expected = f"--max-model-len {limit + 1} exceeds the model's max_position_embeddings ({limit})"
    assert expected in err


@pytest.mark.parametrize("flag", ["--max-model-len", "--max-tokens-limit"])
def test_zero_limits_are_refused_not_unset(tiny_llama_dir: Path, capsys, flag: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(tiny_llama_dir, flag, "0")
    assert exit_.value.code == 2
    assert f"{flag} must be" in capsys.readouterr().err


def test_limit_errors_name_the_flag_and_value(tiny_llama_dir: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--max-tokens-limit", "-5")
    assert "--max-tokens-limit must be in [1, 2048] (--max-model-len), got -5" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--max-concurrent-requests", "0")
    assert "--max-concurrent-requests must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--max-queued-requests", "-1")
    assert "--max-queued-requests must be >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--responses-store-size", "-1")
    assert "--responses-store-size must be >= 0 (0: none), got -1" in capsys.readouterr().err
    assert parse(tiny_llama_dir).responses_store_size == 1024
    # --hf-overrides as the nodes': the context the gateway allows follows an override.
    shorter = parse(tiny_llama_dir, "--hf-overrides", '{"max_position_embeddings": 64}')
    assert shorter.limits.max_model_len == 64
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--hf-overrides", '{"max_position_embeddings": 64}',
              "--max-model-len", "100")  # fmt: skip
    assert "--max-model-len 100 exceeds the model's max_position_embeddings (64)" in (
        capsys.readouterr().err
    )
    assert parse(tiny_llama_dir, "--responses-store-size", "0").responses_store_size == 0
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--http-port", "70000")
    assert "--http-port must be in [0, 65535], got 70000" in capsys.readouterr().err


def test_reasoning_parser_choices_are_plain_values(tiny_llama_dir: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--reasoning-parser", "foo")
    err = capsys.readouterr().err
    assert "(choose from 'qwen3', 'deepseek_r1')" in err and "ReasoningParser" not in err


@pytest.mark.parametrize("names", [(" ",), ("tiny", " ")])
def test_whitespace_served_model_name_is_refused(
    tiny_llama_dir: Path, capsys, names: tuple[str, ...]
) -> None:
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--served-model-name", *names)
    assert "--served-model-name" in capsys.readouterr().err
