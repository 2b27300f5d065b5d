"""Node flags: command line over PDSERVE_* variables over defaults; bad values name the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine import SchedulingPolicy
from services.node.config import NodeConfig, Role, name_flags, parse_bytes, parse_node_config


def test_defaults_per_role() -> None:
    for role, port in ((Role.PREFILL, 50061), (Role.DECODE, 50071), (Role.COLOCATED, 50081)):
        config = parse_node_config([], {}, role=role)
        assert config.role is role and config.grpc_port == port
    config = parse_node_config([], {}, role=Role.DECODE)
    assert config.engine.cache.block_size == 16 and config.kv_transport == "auto"
    assert config.kv_scope == "host"
    assert config.metrics_port is None and config.engine.cache.enable_prefix_caching
    assert config.test_kv_push_pause_s == 0.0  # the test hook is off unless asked for


def test_vllms_spellings_of_the_same_settings_are_taken() -> None:
    """A vLLM command line's --enable-prefix-caching, --no-enable-prefix-caching and
    --enforce-eager start a node with what they mean there; errors name pdserve's own flag."""

    def parse(*argv: str) -> NodeConfig:
        return parse_node_config(list(argv), {}, role=Role.DECODE)

    assert parse("--enable-prefix-caching").engine.cache.enable_prefix_caching
    assert not parse("--no-enable-prefix-caching").engine.cache.enable_prefix_caching
    on_again = parse("--no-prefix-caching", "--enable-prefix-caching")
    assert on_again.engine.cache.enable_prefix_caching  # the last flag wins, as in vLLM
    assert parse("--enforce-eager").engine.cuda_graphs is False
    assert parse().engine.cuda_graphs is None  # auto
    overrides = parse("--hf-overrides", '{"is_matryoshka": true}').engine.hf_overrides
    assert overrides == {"is_matryoshka": True} and parse().engine.hf_overrides is None
    speculative = parse(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
    ).engine.speculative
    assert speculative is not None and parse().engine.speculative is None
    assert (speculative.num_speculative_tokens, speculative.prompt_lookup_max) == (3, 4)
    from_env = parse_node_config(
        [], {"PDSERVE_SPECULATIVE_CONFIG": '{"num_speculative_tokens": 2}'}, role=Role.DECODE
    ).engine.speculative
    assert from_env is not None and from_env.num_speculative_tokens == 2
    assert name_flags("cuda_graphs and no_prefix_caching") == (
        "--cuda-graphs and --no-prefix-caching"
    )


def test_environment_fills_what_the_command_line_leaves_out() -> None:
    env = {
        "PDSERVE_MODEL": "/models/qwen",
        "PDSERVE_DTYPE": "float32",
        "PDSERVE_GRPC_PORT": "6000",
        "PDSERVE_KV_CACHE_MEMORY": "2GiB",
        "PDSERVE_MAX_NUM_SEQS": "8",
        "PDSERVE_KV_TRANSPORT": "loopback",
        "PDSERVE_NO_PREFIX_CACHING": "true",
        "PDSERVE_SCHEDULING_POLICY": "priority",
        "PDSERVE_METRICS_PORT": "9100",
        "PDSERVE_TEST_KV_PUSH_PAUSE_S": "0.5",
        "PDSERVE_QUANTIZATION": "fp8",
    }
    config = parse_node_config(
        ["--grpc-port", "7000", "--max-num-seqs", "4"], env, role=Role.PREFILL
    )
    assert config.grpc_port == 7000 and config.engine.scheduler.max_num_seqs == 4  # flags win
    assert config.engine.model_dir == Path("/models/qwen") and config.engine.dtype == "float32"
    assert config.engine.cache.kv_cache_memory == 2 * 2**30
    assert config.kv_transport == "loopback" and config.metrics_port == 9100
    assert not config.engine.cache.enable_prefix_caching
    assert config.engine.scheduler.policy is SchedulingPolicy.PRIORITY
    assert config.test_kv_push_pause_s == 0.5
    assert config.engine.quantization == "fp8"
    assert parse_node_config([], {}, role=Role.PREFILL).engine.quantization is None


def test_step_budget_defaults_to_the_devices_and_a_flag_or_variable_wins(cuda_visible) -> None:
    def budget(argv: list[str], env: dict[str, str] | None = None) -> int:
        config = parse_node_config(argv, env or {}, role=Role.DECODE)
        return config.engine.scheduler.max_num_batched_tokens

    assert budget([]) == 2048  # CPU
    assert budget(["--device", "cuda"]) == budget(["--device", "cuda:1"]) == 8192  # serving GPU
    assert budget(["--device", "cuda", "--max-num-batched-tokens", "4096"]) == 4096
    assert budget(["--device", "cuda"], {"PDSERVE_MAX_NUM_BATCHED_TOKENS": "1024"}) == 1024


def test_role_can_come_from_the_environment() -> None:
    assert parse_node_config([], {"PDSERVE_ROLE": "colocated"}).role is Role.COLOCATED


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"PDSERVE_MAX_NUM_SEQS": "lots"}, "PDSERVE_MAX_NUM_SEQS (for --max-num-seqs)"),
        ([], {"PDSERVE_KV_TRANSPORT": "carrier-pigeon"}, "PDSERVE_KV_TRANSPORT"),
        (["--kv-cache-memory", "huge"], {}, "not a byte size"),
        (["--block-size", "0"], {}, "--block-size must be a positive integer"),
        (["--dtype", "int8"], {}, "--dtype"),
        (["--hf-overrides", "{is_matryoshka: true}"], {}, "--hf-overrides: not JSON"),
        (["--hf-overrides", "[1]"], {}, "--hf-overrides: not a JSON object"),
        (["--quantization", "awq"], {}, "--quantization: invalid choice: 'awq'"),
        (["--speculative-config", "[3]"], {}, "--speculative-config: not a JSON object"),
        (
            ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
            {},
            "--speculative-config.method must be one of ngram, got 'eagle'",
        ),
        (
            ["--speculative-config", '{"method": "ngram"}'],
            {},
            "--speculative-config.num_speculative_tokens is required",
        ),
        (["--grpc-port", "70000"], {}, "--grpc-port must be in [0, 65535]"),
        (["--test-kv-push-pause-s", "-1"], {}, "--test-kv-push-pause-s must be >= 0"),
        ([], {}, "--role is required"),
        # Engine and node fields are named by their flags.
        (["--max-num-seqs", "0"], {}, "--max-num-seqs must be a positive integer, got 0"),
        (["--gpu-memory-utilization", "2"], {}, "--gpu-memory-utilization must be in (0, 1]"),
        (["--max-unstarted-reservations", "0"], {}, "--max-unstarted-reservations must be"),
        # Checked before the model loads: a port, and settings this machine cannot run.
        (["--metrics-port", "70000"], {}, "--metrics-port must be in [0, 65535], got 70000"),
        (["--metrics-port", "-1"], {}, "--metrics-port must be in [0, 65535], got -1"),
        (["--grpc-port", "9100", "--metrics-port", "9100"], {}, "must differ, both are 9100"),
        (["--block-size", "100000"], {}, "--block-size must be in [1, 128], got 100000"),
        (["--attention-backend", "triton"], {}, "--attention-backend triton needs a CUDA"),
        (["--kv-transport", "cuda_ipc"], {}, "--kv-transport cuda_ipc carries GPU memory"),
        (["--kv-cache-memory", "100000GiB"], {}, "--kv-cache-memory of 107374182400000 bytes"),
        # The role flag lists its choices, and names the other module for the other role.
        (["--role", "prefil"], {}, "invalid choice: 'prefil' (choose from 'decode', 'colocated')"),
        (["--role", "prefill"], {}, "--role prefill runs as python -m prefill_node"),
        ([], {"PDSERVE_ROLE": "prefill"}, "--role prefill runs as python -m prefill_node"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(argv, env, message, capsys, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    role = None if message == "--role is required" else Role.DECODE
    with pytest.raises(SystemExit) as exit_info:
        parse_node_config(argv, env, role=role)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_bytes() -> None:
    assert parse_bytes("1000") == 1000
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("2 gib") == 2 * 2**30


def test_metrics_and_grpc_ports_of_0_are_any_free_ports_and_do_not_collide() -> None:
    config = parse_node_config(["--grpc-port", "0", "--metrics-port", "0"], {}, role=Role.DECODE)
    assert config.grpc_port == config.metrics_port == 0


def test_prefill_node_refuses_the_decode_roles_naming_decode_node(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_node_config(["--role", "colocated"], {}, role=Role.PREFILL)
    assert exit_info.value.code == 2
    assert "--role colocated runs as python -m decode_node" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused_before_the_model_loads(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_node_config(["--device", "cuda"], {}, role=Role.DECODE)
    assert exit_info.value.code == 2
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", ["--test-kv-push-pause-s", "--drain-grace-s", "--test-step-delay-s"]
)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_float_flags_refuse_values_that_are_not_finite(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_node_config(["--role", "colocated", f"{flag}={value}"])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err
