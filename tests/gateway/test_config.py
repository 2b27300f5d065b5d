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


def test_local_prefill_max_tokens_from_flag_env_or_default(tiny_llama_dir, capsys) -> None:
    assert parse(tiny_llama_dir).router.local_prefill_max_tokens == 0
    flag = parse(tiny_llama_dir, "--local-prefill-max-tokens", "128")
    assert flag.router.local_prefill_max_tokens == 128
    from_env = parse(tiny_llama_dir, PDSERVE_LOCAL_PREFILL_MAX_TOKENS="64")
    assert from_env.router.local_prefill_max_tokens == 64
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--local-prefill-max-tokens", "-1")
    assert "local_prefill_max_tokens must be >= 0" in capsys.readouterr().err


def test_reasoning_parser_from_flag_env_or_default(tiny_llama_dir: Path, capsys) -> None:
    assert parse(tiny_llama_dir).reasoning_parser is None
    assert parse(tiny_llama_dir, "--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
    from_env = parse(tiny_llama_dir, PDSERVE_REASONING_PARSER="deepseek_r1")
    assert from_env.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        parse(tiny_llama_dir, "--reasoning-parser", "o1")
    assert "invalid choice: 'o1'" in capsys.readouterr().err


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
