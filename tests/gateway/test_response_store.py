"""The Responses API's store: bounded by entries and by characters, least recently used out
first, and each response its API key's own."""

from __future__ import annotations

import pytest

from gateway.http_api.response_store import ResponseStore


def turn(text: str) -> list[dict[str, object]]:
    return [{"role": "user", "content": text}]


def test_least_recently_used_goes_first_past_max_entries() -> None:
    store = ResponseStore(max_entries=2)
    store.put("a", {"id": "a"}, turn("x"), None)
    store.put("b", {"id": "b"}, turn("x"), None)
    assert store.get("a", None) is not None  # a is now the most recently used
    store.put("c", {"id": "c"}, turn("x"), None)
    assert store.get("b", None) is None
    assert store.get("a", None) is not None and store.get("c", None) is not None
    assert len(store) == 2


def test_the_characters_held_are_bounded() -> None:
    store = ResponseStore(max_entries=10, max_chars=10)
    store.put("a", {}, turn("12345"), None)
    store.put("b", {}, [{"role": "user", "content": [{"type": "text", "text": "1234"}]}], None)
    store.put("c", {}, turn("123"), None)  # 12 characters: a goes
    assert [key for key in "abc" if store.get(key, None)] == ["b", "c"]
    store.put("big", {}, turn("x" * 11), None)  # more than the whole store: not kept
    assert store.get("big", None) is None and len(store) == 2
    store.put("b", {}, turn("1"), None)  # replaced: its old characters are freed
    store.put("d", {}, turn("123456"), None)
    assert [key for key in "bcd" if store.get(key, None)] == ["b", "c", "d"]


def test_another_key_sees_nothing() -> None:
    store = ResponseStore(max_entries=4)
    store.put("a", {"id": "a"}, turn("x"), "team-a")
    assert store.get("a", "team-b") is None and store.get("a", None) is None
    assert not store.delete("a", "team-b")
    stored = store.get("a", "team-a")
    assert stored is not None and stored.response == {"id": "a"}
    assert store.delete("a", "team-a") and store.get("a", "team-a") is None


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(max_entries=0)
