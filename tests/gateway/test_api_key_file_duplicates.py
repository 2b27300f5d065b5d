"""``--api-key-file``: a key given twice in one mapping is refused, naming the file, the field
and the line, never a secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.api_key_file import load_api_key_file


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "keys:\n  - {name: a, key: sk-one-1234}\nkeys:\n  - {name: b, key: sk-two-5678}\n",
            "duplicate 'keys' (line 3, first on line 1)",
        ),
        (
            "keys:\n  - name: a\n    key: sk-one-1234\n    name: b\n",
            "duplicate 'name' (line 4, first on line 2)",
        ),
        (
            '{"keys": [{"name": "a", "key": "sk-one-1234", "key": "sk-two-5678"}]}',
            "duplicate 'key' (line 1, first on line 1)",
        ),
        # A repeated key that is no field might be a secret pasted in the wrong place.
        (
            "keys:\n  - {name: a, key: sk-1x, sk-secret-9: 1, sk-secret-9: 2}\n",
            "duplicate a key (line 2, first on line 2)",
        ),
    ],
)
def test_a_duplicate_key_is_refused_naming_file_field_and_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="duplicate") as refused:
        load_api_key_file(path)
    assert str(refused.value) == f"--api-key-file: {path}: {message}"
    assert "sk-secret" not in str(refused.value) and "sk-two" not in str(refused.value)


def test_a_file_without_duplicates_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - {name: a, key: sk-one-1234}\n  - {name: b, key: sk-two-5678}\n")
    assert [k.name for k in load_api_key_file(path)] == ["a", "b"]
