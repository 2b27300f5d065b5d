"""Per-stage timings of one request (design §7), and the clock that measures a node's part.

Stages, in seconds, each 0.0 where it did not apply:

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

All moments are ``time.monotonic()`` of one process: a node measures its own stages, and the
prefill node's travel to the decode node as durations in the commit.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine import EngineCoreOutput


@dataclass(frozen=True)
class StageTimings:
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_queue_s: float = 0.0
    first_decode_step_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class DecodeClock:
    """Moments of one request on a decode (or colocated) node, fed with each engine output.

    ``started`` is the node's arrival time when it computes the prompt itself, or the moment it
    accepted the commit when the prompt's KV came from a prefill node (``from_peer``); in that
    case the stream's first token is the first decode step's (the prefill node sampled token 1).
    """

    started: float
    from_peer: bool
    first_scheduled: float | None = None
    first_token: float | None = None
    second_token: float | None = None
    last_token: float | None = None

    def observe(self, output: EngineCoreOutput, now: float) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = output.first_scheduled_time
        if not output.new_token_ids:
            return
        if self.first_token is None:
            self.first_token = now
        elif self.second_token is None:
            self.second_token = now
        self.last_token = now

    def timings(self, prefill: StageTimings | None = None) -> StageTimings:
        """The stages measured here; a peer's prefill stages are taken from ``prefill``."""
        if self.from_peer:
            prefill = prefill or StageTimings()
            if self.first_scheduled is None or self.first_token is None:
                # The first token already ended the request: no decode step ran.
                return StageTimings(
                    prefill.prefill_queue_s, prefill.prefill_compute_s, prefill.kv_transfer_s
                )
            assert self.last_token is not None
            return StageTimings(
                prefill_queue_s=prefill.prefill_queue_s,
                prefill_compute_s=prefill.prefill_compute_s,
                kv_transfer_s=prefill.kv_transfer_s,
                decode_queue_s=max(self.first_scheduled - self.started, 0.0),
                first_decode_step_s=self.first_token - self.first_scheduled,
                decode_s=self.last_token - self.first_scheduled,
            )
        if self.first_scheduled is None or self.first_token is None:
            return StageTimings()  # aborted before its first token
        assert self.last_token is not None
        return StageTimings(
            prefill_queue_s=max(self.first_scheduled - self.started, 0.0),
            prefill_compute_s=self.first_token - self.first_scheduled,
            first_decode_step_s=(
                self.second_token - self.first_token if self.second_token is not None else 0.0
            ),
            decode_s=self.last_token - self.first_token,
        )
