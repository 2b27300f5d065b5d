"""A gRPC channel to a process that is still starting.

gRPC redials a refused address after a back-off that grows to two minutes: a channel made when
a node's process is launched, and polled until the node answers, saw the node seconds after it
listened. This one redials at most a second apart, with the gateway's own node-channel options
(``gateway.routing.node_client.REDIAL_OPTIONS``).
"""

from __future__ import annotations

import grpc

from gateway.routing.node_client import REDIAL_OPTIONS


def startup_channel(address: str) -> grpc.Channel:
    """A plaintext channel to ``address`` that redials at most a second apart."""
    return grpc.insecure_channel(address, options=list(REDIAL_OPTIONS))
