"""What a receiver publishes so that a writer can push pages into its registered regions."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PeerAddress:
    # Name of the transport that made it ("loopback", "ucx", "shm", "cuda_ipc").
    transport: str
    # What the transport needs to reach the peer: a UCX worker address, a loopback id, the shm
    # and cuda_ipc handles of the peer's control table and of each region (JSON), ...
    endpoint: bytes
    # Registered regions of the peer: name → length in bytes. Writes are checked against it
    # before any byte moves.
    regions: dict[str, int] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """A compact serialisation for control messages (a protobuf `bytes` field)."""
        doc = {
            "transport": self.transport,
            "endpoint": base64.b64encode(self.endpoint).decode(),
            "regions": self.regions,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerAddress:
        doc = json.loads(data)
        return cls(
            transport=doc["transport"],
            endpoint=base64.b64decode(doc["endpoint"]),
            regions={str(k): int(v) for k, v in doc["regions"].items()},
        )
