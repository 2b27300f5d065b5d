"""YAML for configuration files (the topology, ``--api-key-file``): ``yaml.safe_load``, except
that a key given twice in one mapping is an error instead of silently keeping the last value
(two ``keys:`` lists would otherwise drop the first team's keys without a word).

Torch-free and grpc-free: the launcher, the generators and the gateway all read it.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(ConstructorError):
    """A mapping names one key twice; ``line`` (1-based) is where the second one is."""

    def __init__(self, key: object, line: int, first_line: int) -> None:
        super().__init__(problem=f"duplicate key {key!r} (line {line}, first on line {first_line})")
        self.key = key
        self.line = line
        self.first_line = first_line

    def __str__(self) -> str:
        return str(self.problem)


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated within one mapping. Keys brought in by a
    merge (``<<: *defaults``) may still be overridden: that is what a merge is for."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in first_lines:
                    raise DuplicateKeyError(key, line, first_lines[key])
                first_lines[key] = line
            except TypeError:
                continue  # an unhashable key: SafeLoader's own error names it below
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """The document in ``text`` (None when empty); raises ``DuplicateKeyError`` for a repeated
    key, ``yaml.YAMLError`` for any other syntax error."""
    # Any: a document is whatever the file holds; callers check its shape. The loader is a
    # SafeLoader, so this is as safe as yaml.safe_load.
    return yaml.load(text, Loader=UniqueKeyLoader)
