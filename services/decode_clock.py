"""The clock that measures a decode (or colocated) node's stages of one request.

The stages are ``services.types.StageTimings``'s (design §7). All moments are
``time.monotonic()`` of one process: a node measures its own stages, and the prefill node's
travel to the decode node arrives as durations in the commit.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine import EngineCoreOutput
from services.types import StageTimings


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
                    prefill_queue_s=prefill.prefill_queue_s,
                    prefill_compute_s=prefill.prefill_compute_s,
                    kv_transfer_s=prefill.kv_transfer_s,
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
