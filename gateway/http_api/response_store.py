"""Stored Responses API responses: what ``previous_response_id`` continues, and what ``GET`` and
``DELETE /v1/responses/{id}`` read and remove (OpenAI's ``store``, on by default there; vLLM
keeps them in memory behind ``VLLM_ENABLE_RESPONSES_API_STORE``).

Life cycle: a response is put once it has ended (completed, incomplete, failed or cancelled),
unless its request said ``store: false``; it stays until deleted or evicted, least recently used
first, when more than ``max_entries`` responses or ``max_chars`` characters of their
conversations would be held. Each entry holds its whole conversation (the earlier turns it
continued, its input and its output), so a continuation reads one entry. In memory and per
gateway: a restart forgets every response, and behind several gateways a continuation must
reach the gateway that served the response it names.

Each entry records the API key that created it (None without keys); any other key is told the
response does not exist, as OpenAI answers for another organisation's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_CHARS = 16 << 20
"""Characters of conversation text held in all, at most (a bound on memory: a long chain of
continuations holds its history once per response)."""

Message = dict[str, Any]
"""A chat message as the chat route takes it: ``role`` and ``content`` (text or text parts)."""


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    """The response object as it was returned (``ResponseObject.model_dump()``)."""
    conversation: tuple[Message, ...]
    """The turns a continuation starts from: the conversation this response continued, its
    input messages (not its ``instructions``, which OpenAI does not carry over) and its output
    as an assistant message."""
    owner: str | None
    """The name of the API key that created it; None where the gateway has no keys."""
    chars: int = field(init=False)
    """The conversation's text, counted once (what the store's ``max_chars`` bounds)."""

    def __post_init__(self) -> None:
        chars = sum(_message_chars(message) for message in self.conversation)
        object.__setattr__(self, "chars", chars)


class ResponseStore:
    def __init__(self, max_entries: int, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        if max_entries < 1 or max_chars < 1:
            raise ValueError("max_entries and max_chars must be >= 1")
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        # Puts come from the event loop, lookups from the request's worker thread.
        self._lock = threading.Lock()

    def put(
        self,
        response_id: str,
        response: dict[str, Any],
        conversation: Sequence[Message],
        owner: str | None,
    ) -> None:
        entry = StoredResponse(response, tuple(conversation), owner)
        with self._lock:
            self._remove(response_id)
            if entry.chars > self.max_chars:
                return  # larger than the whole store: kept by none
            self._entries[response_id] = entry
            self._chars += entry.chars
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                self._remove(next(iter(self._entries)))

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The response, or None where there is none under that id for this key."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return None
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            self._remove(response_id)
            return True

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_chars(self) -> int:
        """Characters of conversation text held in all (bounded by ``max_chars``)."""
        return self._chars

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars -= entry.chars


def _message_chars(message: Message) -> int:
    """The text a message holds: its content and its tool calls' names and arguments."""
    content = message.get("content")
    chars = len(content) if isinstance(content, str) else 0
    if isinstance(content, list):
        chars += sum(len(part.get("text", "")) for part in content)
    for call in message.get("tool_calls", ()):
        chars += len(call["function"]["name"]) + len(call["function"]["arguments"])
    return chars
