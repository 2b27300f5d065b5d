"""``--api-key-file``: API keys with names and per-key limits, one YAML (or JSON) file::

    keys:
      - name: team-a               # shown in metrics and logs
        key: sk-team-a-4f9c...     # the secret clients send as 'Authorization: Bearer ...'
        requests_per_minute: 60    # each limit is optional; absent means no bound
        tokens_per_minute: 100000  # prompt + generated tokens
        max_concurrent: 4

An error names the entry by its position and name, never by its key.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import yaml

from gateway.auth import ApiKey, KeyLimits
from services.yaml_load import DuplicateKeyError, load_yaml

_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
_FIELDS = ("name", "key", *_LIMIT_FIELDS)


def load_api_key_file(path: Path) -> tuple[ApiKey, ...]:
    """The keys of ``path``; raises ``ValueError`` naming the file and the entry at fault."""
    try:
        document = load_yaml(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file: cannot read {path}: {exc}") from None
    except DuplicateKeyError as exc:
        # Last-wins would drop the first value (a whole team's keys) silently. A field name is
        # safe to show; any other key might be a secret written in the wrong place.
        shown = repr(exc.key) if exc.key in ("keys", *_FIELDS) else "a key"
        raise ValueError(
            f"--api-key-file: {path}: duplicate {shown} (line {exc.line}, first on line "
            f"{exc.first_line})"
        ) from None
    except yaml.YAMLError:
        # The parser's message may quote the line, which may hold a key: say only where.
        raise ValueError(f"--api-key-file: {path} is not valid YAML or JSON") from None
    if not isinstance(document, dict) or set(document) != {"keys"}:
        raise ValueError(f"--api-key-file: {path} must hold one mapping with a 'keys' list")
    entries = document["keys"]
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--api-key-file: {path}: 'keys' must be a non-empty list")
    keys: list[ApiKey] = []
    for index, entry in enumerate(entries, start=1):
        where = f"--api-key-file: {path}: entry {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not a mapping")
        unknown = sorted(set(map(str, entry)) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; fields are {list(_FIELDS)}")
        name, key = entry.get("name"), entry.get("key")
        if not isinstance(name, str) or not isinstance(key, str):
            raise ValueError(f"{where}: 'name' and 'key' must both be strings")
        try:
            api_key = ApiKey(
                name=name,
                key=key,
                limits=KeyLimits(**{field: entry.get(field) for field in _LIMIT_FIELDS}),
            )
        except ValueError as exc:
            raise ValueError(f"{where} ({name!r}): {exc}") from None
        for other_index, other in enumerate(keys, start=1):
            if other.name == api_key.name:
                raise ValueError(f"{where}: name {name!r} is also entry {other_index}'s")
            if hmac.compare_digest(other.key.encode(), api_key.key.encode()):
                raise ValueError(f"{where} ({name!r}) has the same key as entry {other_index}")
        keys.append(api_key)
    return tuple(keys)
