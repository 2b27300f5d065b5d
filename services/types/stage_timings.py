"""Seconds spent in each stage of one request (design §7), as nodes and the gateway report them.

Stages, each 0.0 where it did not apply:

- ``prefill_queue_s``     arrival at the node that computed the prompt → its first step.
- ``prefill_compute_s``   that first step → the first token.
- ``kv_transfer_s``       the push of the prompt's pages (0 when the prompt was computed where
                          it decodes: a colocated node, or a decode node that recomputed).
- ``decode_queue_s``      the decode node accepted the commit → the request's first decode step
                          (0 when the prompt was computed where it decodes: it never leaves the
                          batch).
- ``first_decode_step_s`` the first decode step's start → the token it produced.
- ``decode_s``            the first decode step's start → the last token (includes
                          ``first_decode_step_s``).
- ``gateway_queue_s``     the gateway: arrival → admission (0 on a node).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageTimings:
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_queue_s: float = 0.0
    first_decode_step_s: float = 0.0
    decode_s: float = 0.0
    gateway_queue_s: float = 0.0
