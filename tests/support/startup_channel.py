"""A gRPC channel to a process that is still starting.

gRPC redials a refused address after a back-off that grows to two minutes: a channel made when
a node's process is launched, and polled until the node answers, saw the node up to ~30 s after
it listened (a node starts in ~7 s on a 2-core host). This channel redials at most a second
apart, as the gateway's own node channels do (``gateway/routing/node_client.py``).
"""

from __future__ import annotations

import grpc

REDIAL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def startup_channel(address: str) -> grpc.Channel:
    """A plaintext channel to ``address`` that redials at most a second apart."""
    return grpc.insecure_channel(address, options=REDIAL_OPTIONS)
