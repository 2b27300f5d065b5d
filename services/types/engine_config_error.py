"""The engine's refusal of a setting or a model it cannot run with."""

from __future__ import annotations


class EngineConfigError(ValueError):
    """A setting the caller chose (``block_size``, ``kv_cache_memory``, ``device``...) or a model
    it pointed at that the engine cannot run with; the message names the setting by its field
    name. Raised while the engine is configured and built, never for a request.

    A node turns exactly these (and ``ModelFileError``, ``OSError``) into a one-line start-up
    refusal; any other exception out of the engine's construction is a bug and keeps its
    traceback. A ``ValueError``, so that the offline ``LLM``'s callers catch what they always
    caught."""
