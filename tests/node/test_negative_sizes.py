"""A negative byte size is refused as one, naming the flag, however it is written: argparse alone
reads ``--kv-cache-memory -1GiB`` as a flag without its value ("expected one argument")."""

from __future__ import annotations

import pytest

from services.node.config import parse_node_config
from services.types import Role

REFUSAL = "argument --kv-cache-memory: byte size must be > 0, got "


@pytest.mark.parametrize(
    ("argv", "env", "value"),
    [
        (["--kv-cache-memory", "-1GiB"], {}, "-1GiB"),
        (["--kv-cache-memory=-1GiB"], {}, "-1GiB"),
        (["--kv-cache-memory", "-512"], {}, "-512"),
        (["--kv-cache-memory", "-1e9"], {}, "-1e9"),
        (["--kv-cache-memory", "-0.5 GiB"], {}, "-0.5 GiB"),
        (["--kv-cache-memory", "0"], {}, "0"),
    ],
)
def test_a_negative_kv_cache_memory_is_refused_naming_the_flag(
    argv: list[str], env: dict[str, str], value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_node_config(argv, env, role=Role.DECODE)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{REFUSAL}{value!r}" in err, err
    assert "expected one argument" not in err


def test_a_negative_size_from_the_environment_is_refused_naming_both(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_node_config([], {"PDSERVE_KV_CACHE_MEMORY": "-1GiB"}, role=Role.DECODE)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "PDSERVE_KV_CACHE_MEMORY (for --kv-cache-memory): byte size must be > 0" in err


def test_a_flag_after_a_size_flag_without_its_value_is_still_a_missing_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Only what reads as a negative size joins the flag: another flag is not taken as its value.
    with pytest.raises(SystemExit):
        parse_node_config(["--kv-cache-memory", "--block-size", "16"], {}, role=Role.DECODE)
    assert "--kv-cache-memory: expected one argument" in capsys.readouterr().err


def test_values_that_only_start_with_a_dash_elsewhere_are_left_alone() -> None:
    config = parse_node_config(
        ["--node-id", "n-1", "--kv-cache-memory", "2GiB", "--seed", "-3"], {}, role=Role.DECODE
    )
    assert config.engine.cache.kv_cache_memory == 2 * 2**30
    assert config.engine.seed == -3
