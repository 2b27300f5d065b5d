"""API keys: when any are configured, every request must carry one (HTTP ``Authorization:
Bearer KEY``, gRPC ``authorization`` metadata with the same value)."""

from __future__ import annotations

import hmac

from gateway.errors import ErrorKind, GatewayError


class ApiKeys:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = tuple(key.encode() for key in keys if key)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        """Raises UNAUTHENTICATED unless ``authorization`` is ``Bearer <a configured key>``."""
        if not self._keys:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise GatewayError(
                ErrorKind.UNAUTHENTICATED,
                "missing API key: send 'Authorization: Bearer <key>'",
            )
        candidate = token.strip().encode()
        # compare_digest against every key: the time taken does not say which key came close.
        if not any([hmac.compare_digest(candidate, key) for key in self._keys]):
            raise GatewayError(ErrorKind.UNAUTHENTICATED, "invalid API key")
