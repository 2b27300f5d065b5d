"""Why a request ended: one enum for the engine, the nodes, the gateway and the wire."""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """The values are the OpenAI API's ``finish_reason`` strings (``error`` is pdserve's)."""

    STOP = "stop"
    """EOS, a stop token or a stop string."""
    LENGTH = "length"
    """``max_tokens`` or ``max_model_len``."""
    ABORT = "abort"
    """Cancelled: client gone, deadline, shutdown."""
    ERROR = "error"
    """A failure after tokens were streamed: the gateway's (a node lost), or the engine's when
    llguidance gave up on a request's grammar while it ran (``EngineCoreOutput.error`` says
    why)."""
