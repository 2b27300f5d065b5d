"""Reasoning output of thinking models (Qwen3, DeepSeek-R1 and its distills) as the chat API's
``reasoning_content`` (the gRPC API's ``reasoning``), apart from ``content``: vLLM's
``--reasoning-parser``.

These models write their reasoning between ``<think>`` and ``</think>``, then the answer. Two
conventions, by where ``<think>`` is written:

- ``deepseek_r1``: the chat template ends the prompt with ``<think>``, so the output starts inside
  the reasoning (a ``<think>`` the model repeats is dropped); everything up to ``</think>`` is
  reasoning, the rest content. An output without ``</think>`` (cut by ``max_tokens``) is all
  reasoning.
- ``qwen3``: the model writes ``<think>`` itself, first; output that does not start with it
  (thinking switched off: ``chat_template_kwargs: {"enable_thinking": false}`` puts an empty
  block in the prompt) is all content. After ``<think>``, reasoning until ``</think>`` or the
  end. (vLLM's qwen3 parser returns an unfinished block as content when not streaming, and as
  reasoning when streaming; here both give reasoning, so a stream and a whole response agree.)

Text after ``</think>`` is content as it comes (Qwen3 starts it with a blank line; vLLM keeps it).
A grammar (structured output, a forced tool call) constrains the whole output, so such a request
gets no reasoning.

Life cycle: one ``ReasoningStream`` per choice; ``feed`` each text delta (returns what to send
now, as reasoning and as content), ``finish`` once at the end (what was held back: a tail that
might have begun a tag).
"""

from __future__ import annotations

import enum

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser(enum.StrEnum):
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"


class _Phase(enum.Enum):
    OPENING = enum.auto()  # qwen3: not yet known whether the output starts with <think>
    REASONING = enum.auto()
    CONTENT = enum.auto()


class ReasoningStream:
    """One choice's text → (reasoning, content) pieces, as it streams."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._phase = _Phase.OPENING if parser is ReasoningParser.QWEN3 else _Phase.REASONING
        self._pending = ""
        """Text received and not yet sent: a tail that may be the start of a tag."""
        self._at_start = parser is ReasoningParser.DEEPSEEK_R1
        """deepseek_r1: nothing sent yet, so a leading <think> is still to be dropped."""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to send for ``text``; either may be empty."""
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._phase is _Phase.CONTENT:
                content.append(self._pending)
                self._pending = ""
            elif self._phase is _Phase.OPENING:
                stripped = self._pending.lstrip()
                if stripped.startswith(THINK_START):
                    self._pending = stripped[len(THINK_START) :]
                    self._phase = _Phase.REASONING
                elif THINK_START.startswith(stripped):
                    break  # maybe the start of <think>: wait for more
                else:
                    self._phase = _Phase.CONTENT
            else:
                if self._at_start:
                    stripped = self._pending.lstrip()
                    if stripped.startswith(THINK_START):
                        self._pending = stripped[len(THINK_START) :]
                    elif THINK_START.startswith(stripped):
                        break
                    self._at_start = False
                    continue
                end = self._pending.find(THINK_END)
                if end >= 0:
                    reasoning.append(self._pending[:end])
                    self._pending = self._pending[end + len(THINK_END) :]
                    self._phase = _Phase.CONTENT
                    continue
                keep = _tag_prefix_len(self._pending, THINK_END)
                reasoning.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning inside an unfinished block, content otherwise."""
        pending, self._pending = self._pending, ""
        if self._phase is _Phase.REASONING:
            if self._at_start and pending.lstrip() == THINK_START:
                return "", ""
            return pending, ""
        return "", pending


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """A whole output as (reasoning_content, content), each None when empty."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text)
    tail_reasoning, tail_content = stream.finish()
    return (reasoning + tail_reasoning) or None, (content + tail_content) or None


def _tag_prefix_len(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
