"""Command-line plumbing shared by every pdserve process (nodes and gateway): ``PDSERVE_*``
environment fallbacks for argparse flags, and byte sizes such as ``2GiB``.

Torch-free, so the gateway can use it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping

ENV_PREFIX = "PDSERVE_"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1e9"`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"byte size must be > 0, got {text!r}")
    return value


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """``PDSERVE_<DEST>`` becomes the default of ``--<dest>``, converted like a flag value."""
    for action in parser._actions:  # argparse has no public iterator over its actions
        if not action.option_strings or action.dest == "help":
            continue
        raw = environ.get(ENV_PREFIX + action.dest.upper())
        if raw is None:
            continue
        option = action.option_strings[0]
        if action.nargs == 0:  # store_true flags: PDSERVE_NO_PREFIX_CACHING=1
            value: object = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            try:
                value = action.type(raw) if action.type else raw
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{ENV_PREFIX}{action.dest.upper()} (for {option}): {exc}")
            if action.choices is not None and value not in action.choices:
                parser.error(
                    f"{ENV_PREFIX}{action.dest.upper()} (for {option}): {raw!r} is not one of "
                    f"{', '.join(map(str, action.choices))}"
                )
        action.default = value
