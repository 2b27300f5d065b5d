"""API keys: when any are configured, every request must carry one (HTTP ``Authorization:
Bearer KEY``, gRPC ``authorization`` metadata with the same value).

A key has a name (what metrics and logs show; the key itself is never logged or exported) and
its own limits (``KeyLimits``, enforced by ``gateway/key_limiter.py``). Keys from ``--api-key``
are named ``key-1``, ``key-2``, ... and unlimited; keys from ``--api-key-file`` carry a name and
limits (``gateway/api_key_file.py``).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.errors import ErrorKind, GatewayError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


@dataclass(frozen=True)
class KeyLimits:
    """Per-key bounds over a sliding minute; None: no bound."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    """Prompt plus generated tokens of the key's requests that started in the last minute."""
    max_concurrent: int | None = None
    """Requests of the key in flight at once (from admission to the last byte sent)."""

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or absent for no limit), got {value}")

    @property
    def is_unlimited(self) -> bool:
        limits = (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent)
        return all(limit is None for limit in limits)


@dataclass(frozen=True)
class ApiKey:
    name: str
    """The key's label in metrics and logs."""
    key: str = field(repr=False)
    """The secret; never in a repr, a log line or a metric."""
    limits: KeyLimits = field(default_factory=KeyLimits)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"API key name {self.name!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        if not self.key or self.key != self.key.strip():
            # The server strips the token it receives: such a key could never match.
            raise ValueError(f"API key {self.name!r}: the key is empty or has surrounding spaces")
        if hmac.compare_digest(self.key.encode(), self.name.encode()):
            # The name is exported in metrics: it must not be the secret.
            raise ValueError(f"API key {self.name!r}: the name must differ from the key")


class ApiKeys:
    def __init__(self, keys: Sequence[str | ApiKey]) -> None:
        # Empty keys are kept so that ApiKey refuses them: dropping the only one would serve
        # with no authentication at all.
        plain = [k for k in keys if isinstance(k, str)]
        entries = [ApiKey(f"key-{i}", k) for i, k in enumerate(plain, start=1)]
        entries += [k for k in keys if isinstance(k, ApiKey)]
        for i, entry in enumerate(entries):
            for other in entries[:i]:
                if other.name == entry.name:
                    raise ValueError(f"two API keys are named {entry.name!r}")
                if hmac.compare_digest(other.key.encode(), entry.key.encode()):
                    raise ValueError(f"API keys {other.name!r} and {entry.name!r} are the same key")
        self._entries = tuple((entry.key.encode(), entry) for entry in entries)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    @property
    def entries(self) -> tuple[ApiKey, ...]:
        return tuple(entry for _, entry in self._entries)

    def check(self, authorization: str | None) -> ApiKey | None:
        """The key that ``authorization`` (``Bearer <key>``) names; None when no keys are
        configured. Raises UNAUTHENTICATED for a missing or unknown key."""
        if not self._entries:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise GatewayError(
                ErrorKind.UNAUTHENTICATED,
                "missing API key: send 'Authorization: Bearer <key>'",
            )
        candidate = token.strip().encode()
        # compare_digest against every key, with no early exit: the time taken does not say
        # which key matched or came close.
        found = None
        for secret, entry in self._entries:
            if hmac.compare_digest(candidate, secret):
                found = entry
        if found is None:
            raise GatewayError(ErrorKind.UNAUTHENTICATED, "invalid API key")
        return found
