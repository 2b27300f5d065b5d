"""The offline ``LLM``'s progress bars (vLLM's ``use_tqdm``), on stderr: ``generate``'s
prompts done out of all with the estimated input and output speeds (``Progress``), and
``beam_search``'s rounds out of ``max_tokens`` (``RoundProgress``).

Life cycle of either: made once a call has its work in hand (``use_tqdm`` False makes one that
shows nothing); ``request_done`` once for each engine request that ends (a prompt of ``n``
samples counts as done with its last), or ``round_done`` once a search round; ``close`` when the
call returns or fails, which leaves the bar where it got to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

UseTqdm = bool | Callable[..., Any]
"""True: tqdm's bar; a callable: made as tqdm's class would be (``total``, ``desc``,
``dynamic_ncols``, ``postfix``) and used as one (``update``, ``set_postfix_str``, ``close``);
False: nothing."""


def check_use_tqdm(use_tqdm: object) -> UseTqdm:
    if isinstance(use_tqdm, bool) or callable(use_tqdm):
        return use_tqdm
    raise ValueError(
        f"use_tqdm must be True, False or a tqdm-like callable, got {type(use_tqdm).__name__}"
    )


class Progress:
    """Counts finished prompts; ``samples[i]`` engine requests make prompt ``i``."""

    def __init__(self, use_tqdm: UseTqdm, samples: Sequence[int]) -> None:
        self._left = list(samples)  # requests of each prompt not yet done
        self._input_tokens = 0
        self._output_tokens = 0
        self._start = time.monotonic()
        self._bar = _bar(
            use_tqdm, total=len(samples), desc="Processed prompts", postfix=_speeds(0.0, 0.0)
        )

    def request_done(self, prompt: int, prompt_tokens: int, output_tokens: int) -> None:
        """One request of prompt ``prompt`` ended after ``output_tokens`` tokens."""
        self._left[prompt] -= 1
        self._input_tokens += prompt_tokens
        self._output_tokens += output_tokens
        if self._bar is None or self._left[prompt]:
            return
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self._bar.set_postfix_str(
            _speeds(self._input_tokens / elapsed, self._output_tokens / elapsed), refresh=False
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class RoundProgress:
    """Counts ``LLM.beam_search``'s rounds (one a generated token) out of ``max_tokens``."""

    def __init__(self, use_tqdm: UseTqdm, max_tokens: int) -> None:
        self._bar = _bar(use_tqdm, total=max_tokens, desc="Beam search")

    def round_done(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _bar(use_tqdm: UseTqdm, **kwargs: Any) -> Any:
    """A bar made as ``use_tqdm`` says (tqdm's, the caller's class, or None for none)."""
    if not use_tqdm:
        return None
    make = tqdm if use_tqdm is True else use_tqdm
    return make(dynamic_ncols=True, **kwargs)


def _speeds(input_rate: float, output_rate: float) -> str:
    return f"est. speed input: {input_rate:.2f} toks/s, output: {output_rate:.2f} toks/s"
