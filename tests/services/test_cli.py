"""``PDSERVE_*`` fallbacks and the shared flag types of every process: a variable means what
the flag given once with its value means, and a value the flag would refuse is refused by name."""

from __future__ import annotations

import argparse
import math

import pytest

from services.cli import AppendOverDefault, apply_env_defaults, finite_float, parse_bytes


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    parser.add_argument("--key", action=AppendOverDefault, default=None)
    parser.add_argument("--name", nargs="+", default=None)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--interval-s", type=finite_float, default=1.0)
    return parser


def parse(argv: list[str], **environ: str) -> argparse.Namespace:
    parser = make_parser()
    apply_env_defaults(parser, environ)
    return parser.parse_args(argv)


def test_append_flag_from_env_is_one_value_that_flags_replace() -> None:
    assert parse([], PDSERVE_KEY="sk-abc").key == ["sk-abc"]
    assert parse(["--key", "a", "--key", "b"], PDSERVE_KEY="sk-abc").key == ["a", "b"]
    assert parse(["--key", "a"]).key == ["a"]


def test_nargs_plus_flag_from_env_splits_on_commas() -> None:
    assert parse([], PDSERVE_NAME="tiny, alias").name == ["tiny", "alias"]
    assert parse([], PDSERVE_NAME="tiny").name == ["tiny"]


@pytest.mark.parametrize("raw", ["1", "true", "YES", " on "])
def test_switch_env_true_values(raw: str) -> None:
    args = parse([], PDSERVE_NO_CACHE=raw, PDSERVE_GRAPHS=raw)
    assert args.no_cache is True and args.graphs is True


@pytest.mark.parametrize("raw", ["0", "false", "No", "OFF"])
def test_switch_env_false_values(raw: str) -> None:
    args = parse([], PDSERVE_NO_CACHE=raw, PDSERVE_GRAPHS=raw)
    assert args.no_cache is False and args.graphs is False


def test_switch_env_refuses_other_words(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse([], PDSERVE_NO_CACHE="enabled")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "PDSERVE_NO_CACHE (for --no-cache): 'enabled' is not a boolean" in err
    with pytest.raises(SystemExit):
        parse([], PDSERVE_GRAPHS="")
    assert "PDSERVE_GRAPHS (for --graphs)" in capsys.readouterr().err


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e999", "NaN"])
def test_float_flags_must_be_finite(raw: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse([f"--interval-s={raw}"])  # "-inf" alone reads as a flag
    assert exit_.value.code == 2
    assert "argument --interval-s: must be a finite number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse([], PDSERVE_INTERVAL_S=raw)
    assert "PDSERVE_INTERVAL_S (for --interval-s)" in capsys.readouterr().err


def test_finite_float_accepts_numbers() -> None:
    assert finite_float("0.5") == 0.5 and finite_float("-2") == -2.0
    assert not math.isnan(finite_float("1e300"))


def test_byte_size_overflow_is_an_argument_error() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("1e999")
