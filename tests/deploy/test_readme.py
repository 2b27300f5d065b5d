"""The README's configuration reference names every node and gateway flag with its PDSERVE_*
variable, so a flag added to a parser without a line in the README fails here."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.config import build_parser as gateway_parser
from services.node.config import Role
from services.node.config import build_parser as node_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def flags(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    return [
        (action.option_strings[0], f"PDSERVE_{action.dest.upper()}")
        for action in parser._actions  # argparse has no public iterator over its actions
        if action.option_strings and action.dest != "help"
    ]


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(title)
    return text[start : text.index("\n**", start + len(title))]


@pytest.mark.parametrize("role", list(Role))
def test_every_node_flag_is_documented(role: Role) -> None:
    rows = section("**Nodes**").splitlines()
    for flag, env in flags(node_parser(role)):
        assert any(f"`{flag}`" in row and f"`{env}`" in row for row in rows), flag


def test_every_gateway_flag_is_documented() -> None:
    rows = section("**Gateway**").splitlines()
    for flag, env in flags(gateway_parser()):
        if flag == "--api-key":  # repeatable; its variable is the plural list
            env = "PDSERVE_API_KEYS"
        assert any(f"`{flag}" in row and env in row for row in rows), flag
