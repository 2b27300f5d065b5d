"""Bounds on what one request may ask for, enforced by both front ends before any node is asked.

Each bound is refused with a message naming the parameter (HTTP 400/413, gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.errors import invalid
from services.types import MAX_LOGPROBS


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    """Prompt tokens + max_tokens must fit (the nodes' context length)."""
    max_tokens: int
    """The largest max_tokens a request may ask for (≤ max_model_len)."""
    max_body_bytes: int = 4 * 2**20
    """HTTP request bodies larger than this are refused with 413."""
    body_read_timeout_s: float | None = 30.0
    """An HTTP body with no new byte for this long is answered 408 (None: wait for ever)."""
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_bad_words: int = 64
    max_bad_word_chars: int = 256
    max_logprobs: int = MAX_LOGPROBS
    """Alternatives per token a request may ask for; at most what the nodes allow."""
    max_prompts: int = 64
    """Prompts in one batched /v1/completions request."""

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 1 <= self.max_tokens <= self.max_model_len:
            raise ValueError(
                f"max_tokens must be in [1, max_model_len={self.max_model_len}], "
                f"got {self.max_tokens}"
            )
        for name in ("max_body_bytes", "max_n", "max_stop_strings", "max_stop_string_chars",
                     "max_bad_words", "max_bad_word_chars", "max_prompts"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.body_read_timeout_s is not None and self.body_read_timeout_s <= 0:
            raise ValueError(f"body_read_timeout_s must be > 0, got {self.body_read_timeout_s}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}"
            )

    def check_stop(self, stop: Sequence[str], param: str = "stop") -> None:
        if len(stop) > self.max_stop_strings:
            raise invalid(
                f"at most {self.max_stop_strings} stop strings, got {len(stop)}", param=param
            )
        for text in stop:
            if not 1 <= len(text) <= self.max_stop_string_chars:
                raise invalid(
                    f"each stop string must have 1 to {self.max_stop_string_chars} characters, "
                    f"got {len(text)}",
                    param=param,
                )

    def check_bad_words(self, words: Sequence[str], param: str = "bad_words") -> None:
        """vLLM's ``bad_words``: each is tokenized and checked at every step of its request."""
        if len(words) > self.max_bad_words:
            raise invalid(f"at most {self.max_bad_words} bad words, got {len(words)}", param=param)
        for index, word in enumerate(words):
            if not word:
                raise invalid(f"{param}[{index}] is empty", param=param)
            if len(word) > self.max_bad_word_chars:
                raise invalid(
                    f"each bad word must have at most {self.max_bad_word_chars} characters, "
                    f"got {len(word)}",
                    param=param,
                )

    def check_logprobs(self, num_logprobs: int | None, param: str) -> None:
        if num_logprobs is not None and num_logprobs > self.max_logprobs:
            raise invalid(
                f"{param} must be <= {self.max_logprobs}, got {num_logprobs}", param=param
            )

    def prompt_tokens_kept(self, keep: int | None, param: str) -> int | None:
        """vLLM's ``truncate_prompt_tokens``, checked: how many of a prompt's last tokens to
        keep (-1: ``max_model_len``); None keeps the whole prompt."""
        if keep is None:
            return None
        if keep == 0 or keep < -1:
            raise invalid(f"{param} must be -1 or at least 1, got {keep}", param=param)
        if keep > self.max_model_len:
            raise invalid(
                f"{param} is {keep}, more than max_model_len={self.max_model_len}", param=param
            )
        return self.max_model_len if keep == -1 else keep

    def output_room(self, prompt_len: int, prompt_param: str) -> int:
        """Tokens left for output after a prompt of ``prompt_len``; refused when none are."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise invalid(
                f"{prompt_param} has {prompt_len} tokens; max_model_len is "
                f"{self.max_model_len}, which leaves no room for output",
                param=prompt_param,
            )
        return room

    def check_max_tokens(
        self, max_tokens: int, prompt_len: int, *, prompt_param: str, max_param: str
    ) -> None:
        """An explicit ``max_tokens``: within the limit, and fits with the prompt."""
        room = self.output_room(prompt_len, prompt_param)
        if max_tokens > self.max_tokens:
            raise invalid(
                f"{max_param} must be <= {self.max_tokens}, got {max_tokens}", param=max_param
            )
        if max_tokens > room:
            raise invalid(
                f"{prompt_param} has {prompt_len} tokens and {max_param} is {max_tokens}: more "
                f"than max_model_len={self.max_model_len} together",
                param=max_param,
            )


def check_prompt_ids(prompts: Sequence[Sequence[int]], vocab_size: int, param: str) -> None:
    """Every prompt holds a token, and only ids of the vocabulary; the error names ``param``
    (``param[i]`` for one of several)."""
    for index, ids in enumerate(prompts):
        where = param if len(prompts) == 1 else f"{param}[{index}]"
        if not ids:
            raise invalid(f"{where} is empty", param=param)
        out_of_vocab = next((token_id for token_id in ids if token_id >= vocab_size), None)
        if out_of_vocab is not None:
            raise invalid(
                f"{where} has token id {out_of_vocab}, outside the vocabulary [0, {vocab_size})",
                param=param,
            )
