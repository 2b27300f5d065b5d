"""Command-line plumbing shared by every pdserve process (nodes and gateway): ``PDSERVE_*``
environment fallbacks for argparse flags, and flag types (byte sizes such as ``2GiB``, finite
floats, JSON objects).

A variable means what its flag given once with that value means: ``PDSERVE_API_KEY=k`` is
``--api-key k`` (one key, even for a repeatable flag), ``PDSERVE_SERVED_MODEL_NAME=a,b`` is
``--served-model-name a b`` (a flag that takes several values reads a comma-separated list), and
a switch's variable is one of ``1/0/true/false/yes/no/on/off``. A value the flag would refuse is
refused naming both the variable and the flag.

Torch-free, so the gateway can use it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

ENV_PREFIX = "PDSERVE_"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}  # fmt: skip
_NEGATIVE_NUMBER = re.compile(r"-\.?[0-9]")
"""A word that opens like a negative number: ``-1GiB``, ``-1e9``, ``-0.5``."""
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1e9"`` or a plain number of bytes. A negative one is
    refused as not positive, not as no size at all."""
    match = re.fullmatch(r"\s*(-?[0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    number = float(match.group(1))
    if not math.isfinite(number):  # "1e999": int() would raise OverflowError, not a usage error
        raise argparse.ArgumentTypeError(f"byte size must be finite, got {text!r}")
    value = int(number * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"byte size must be > 0, got {text!r}")
    return value


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON object (``--hf-overrides '{"is_matryoshka": true}'``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def join_negative_sizes(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> list[str]:
    """``argv`` with ``--kv-cache-memory -1GiB`` (a byte-size flag, then a word that opens like
    a negative number) as ``--kv-cache-memory=-1GiB``. argparse takes a word that starts with
    "-" for a flag unless it is a plain negative number (``-1`` is one, ``-1GiB`` and ``-1e9``
    are not) and answers "expected one argument"; joined, the value reaches ``parse_bytes``,
    which refuses it naming the flag. Abbreviated flags (``--kv-cache-mem``) are not joined.
    For ``parser.parse_args``; ``argv`` None: the process's arguments, as argparse reads them."""
    if argv is None:
        argv = sys.argv[1:]
    size_flags = {
        flag
        for action in parser._actions  # argparse has no public iterator
        if action.type is parse_bytes
        for flag in action.option_strings
    }
    joined: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        value = argv[index + 1] if index + 1 < len(argv) else ""
        if word in size_flags and _NEGATIVE_NUMBER.match(value):
            joined.append(f"{word}={value}")
            index += 2
        else:
            joined.append(word)
            index += 1
    return joined


def finite_float(text: str) -> float:
    """A float flag's type: ``nan`` and ``inf`` pass every ``<= 0`` check, so refuse them here
    (``asyncio.sleep(nan)`` raises under uvloop, ``sleep(inf)`` never returns)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


class AppendOverDefault(argparse.Action):
    """``action="append"`` whose flags replace the default (an environment fallback) rather
    than add to it: flags come first, then ``PDSERVE_*``, never both."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        items = getattr(namespace, self.dest, None)
        # argparse sets the default itself (not a copy) before the first flag is seen.
        items = [] if items is None or items is self.default else list(items)
        setattr(namespace, self.dest, [*items, values])


def _is_append(action: argparse.Action) -> bool:
    return isinstance(action, (AppendOverDefault, argparse._AppendAction))


def _takes_list(action: argparse.Action) -> bool:
    return action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """``PDSERVE_<DEST>`` becomes the default of ``--<dest>``, converted like a flag value."""
    for action in parser._actions:  # argparse has no public iterator over its actions
        if not action.option_strings or action.dest == "help":
            continue
        name = ENV_PREFIX + action.dest.upper()
        raw = environ.get(name)
        if raw is None:
            continue
        where = f"{name} (for {action.option_strings[0]})"
        if action.nargs == 0:  # switches: PDSERVE_NO_PREFIX_CACHING=1
            word = raw.strip().lower()
            if word not in _TRUE + _FALSE:
                parser.error(f"{where}: {raw!r} is not a boolean (1/0, true/false, yes/no, on/off)")
            action.default = word in _TRUE
            continue
        texts = [part.strip() for part in raw.split(",")] if _takes_list(action) else [raw]
        values = [_convert(parser, action, where, text) for text in texts]
        # A repeatable flag's variable is the flag given once; a list flag's is its list.
        action.default = values if _is_append(action) or _takes_list(action) else values[0]


def _convert(
    parser: argparse.ArgumentParser, action: argparse.Action, where: str, raw: str
) -> object:
    try:
        value = action.type(raw) if callable(action.type) else raw
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{where}: {exc}")
    if action.choices is not None and value not in action.choices:
        parser.error(
            f"{where}: {raw!r} is not one of {', '.join(map(_choice_text, action.choices))}"
        )
    return value


def _choice_text(choice: object) -> str:
    """An enum choice as its value (``qwen3``), not its repr."""
    return str(getattr(choice, "value", choice))
