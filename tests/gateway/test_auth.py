"""``ApiKeys``: a configured key that is empty is an error, never a silently dropped entry
(dropping the only key would turn authentication off)."""

from __future__ import annotations

import pytest

from gateway.auth import ApiKeys


@pytest.mark.parametrize("keys", [("",), ("sesame", "")])
def test_empty_plain_key_is_refused_not_dropped(keys: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="empty"):
        ApiKeys(keys)


def test_no_keys_means_no_authentication() -> None:
    assert not ApiKeys(()).enabled
    assert ApiKeys(()).check(None) is None
