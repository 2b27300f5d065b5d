"""Per-request sampling parameters, validated at construction (vLLM-compatible names).

The one set of range checks: the engine, the nodes' servicers and the gateway (which turns a
``SamplingParamError`` into a 400 or INVALID_ARGUMENT naming ``param``) all build this type.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast

from services.guided_decoding import GuidedDecoding
from services.types.sampling_param_error import SamplingParamError
from services.types.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
"""The seeds ``torch.Generator.manual_seed`` takes (a negative one is read modulo 2**64); beyond
them it raises mid-step, taking the whole batch down with it, so they are refused up front."""
MAX_N = 1024
"""Samples of one prompt ``SamplingParams.n`` may ask for (each is a request of its own)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Every check raises ``SamplingParamError`` (a ``ValueError``) naming the offending field, so a
    caller (the Python API, a gRPC servicer, the gateway) can pass the message to its client.
    """

    max_tokens: int = 16
    """Upper bound on generated tokens; the request finishes with ``length`` when reached."""
    min_tokens: int = 0
    """EOS and ``stop_token_ids`` are suppressed until this many tokens were generated."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set whose probability mass reaches top_p, in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's, in [0, 1]."""
    seed: int | None = None
    """Per-request seed, in [``MIN_SEED``, ``MAX_SEED``]: the same seed, prompt and parameters
    give the same tokens whatever else is in the batch; None: the engine's shared generator."""
    repetition_penalty: float = 1.0
    """HF/CTRL-style penalty over prompt and output tokens; > 0, 1 disables it."""
    presence_penalty: float = 0.0
    """OpenAI-style: subtracted once from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI-style: subtracted per occurrence of each token already generated, in [-2, 2]."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Token ids that finish the request with ``stop`` (the stop token is kept in the output).
    Any iterable of ids; None is unset, as in vLLM."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token (benchmarks)."""
    logprobs: int | None = None
    """Return the sampled token's log-probability plus this many most likely alternatives (at
    most the vocabulary; the gateway's API allows ``MAX_LOGPROBS``); None: no logprobs."""
    prompt_logprobs: int | None = None
    """Return each prompt token's log-probability given the tokens before it, plus this many
    most likely alternatives; None: none. Such a prompt is computed whole: no prefix-cache hit."""
    priority: int = 0
    """Scheduling priority under the ``priority`` policy: lower values are served first."""
    guided: GuidedDecoding | None = None
    """Constrain the output to a grammar (JSON schema, regex, choice, Lark); None: free text."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, or a ``{token id: bias}`` dict: the bias, in [-100, 100], is
    added to that token's logit. None is unset, as in vLLM."""
    allowed_token_ids: tuple[int, ...] = ()
    """Only these tokens may be sampled (vLLM's ``allowed_token_ids``); empty (or None): every
    token."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences never to generate (vLLM's ``bad_words``, tokenized by the gateway): a
    sequence's last token is forbidden whenever the output so far ends with the tokens before
    it (a one-token sequence: always)."""
    stop: tuple[str, ...] = ()
    """Strings that finish the request with ``stop`` where its text first contains one (vLLM's
    ``stop``: a string or a list; None is unset). Text, so ``LLM.generate`` applies them to
    what it decodes; the engine and the nodes work on token ids and never see them (the
    gateway's APIs take their own ``stop`` field)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string (or the stop token's text) that ended the text in it, as vLLM."""
    n: int = 1
    """Samples of each prompt (vLLM's ``n``), at most ``MAX_N``: ``LLM.generate`` runs each as
    a request of its own (seeded ``seed + i`` where a seed is given) and returns them as one
    output's ``outputs``. A node takes one sample a request (the gateway's APIs fan their own
    ``n`` out)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output's text (vLLM's; text only: ``LLM.generate``)."""
    detokenize: bool = True
    """False: ``LLM.generate`` decodes no text (``text`` None), as vLLM's; stop strings need
    text, so they are refused with it."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (vLLM's; -1: the last ``max_model_len``), applied by
    ``LLM.generate`` before the engine sees the prompt; at most 2**31 - 1."""
    bad_words: tuple[str, ...] = ()
    """Words never to generate (vLLM's): ``LLM.generate`` tokenizes each, at the start of a
    text and after a space, into ``bad_words_token_ids``."""
    structured_outputs: StructuredOutputsParams | None = None
    """vLLM's way to ask for a constraint; construction turns it into ``guided`` (only one of
    the two may be given, unless they agree)."""
    cache_salt: str | None = None
    """Salts the request's prefix-cache block hashes (vLLM's ``cache_salt``): its KV blocks are
    shared only with requests of the same salt, so a client cannot learn from a fast first
    token that another client sent the same prompt. A non-empty string (give each tenant a
    long random one); None: unsalted, shared with every unsalted request."""
    lora_name: str | None = None
    """The LoRA adapter the request runs with, by the name the engine loaded it under (the
    offline ``LLM`` sets it from vLLM's ``lora_request``); None: the base model. Its prefix-cache
    blocks are shared only with requests of the same adapter."""

    def __post_init__(self) -> None:
        # Any iterable of ints (None: unset, as vLLM's default), stored as an immutable tuple.
        object.__setattr__(
            self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids)
        )
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise SamplingParamError(
                "min_tokens",
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}",
            )
        check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamError(
                "temperature", f"temperature must be >= 0, got {self.temperature}"
            )
        check_int("top_k", self.top_k, minimum=-1)
        check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            check_int("seed", self.seed, minimum=MIN_SEED, maximum=MAX_SEED)
        check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise SamplingParamError(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamError(name, f"{name} must be in [-2, 2], got {value}")
        for token_id in self.stop_token_ids:
            check_int("stop_token_ids", token_id, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamError(
                "ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}"
            )
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        check_int("priority", self.priority, minimum=-(2**63))
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise SamplingParamError(
                "guided", f"guided must be a GuidedDecoding, got {type(self.guided).__name__}"
            )
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for _, value in self.logit_bias:
            check_float("logit_bias", value)
            if not -100.0 <= value <= 100.0:
                raise SamplingParamError(
                    "logit_bias", f"logit_bias values must be in [-100, 100], got {value}"
                )
        allowed = _token_ids("allowed_token_ids", self.allowed_token_ids)
        for allowed_id in allowed:
            check_int("allowed_token_ids", allowed_id, minimum=0)
        # Sorted and unique: one canonical form, whatever order or repeats a client sent.
        object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))
        object.__setattr__(self, "bad_words_token_ids", _token_sequences(self.bad_words_token_ids))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        check_int("n", self.n, minimum=1, maximum=MAX_N)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamError(
                    name, f"{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.stop and not self.detokenize:
            raise SamplingParamError(
                "stop", "stop strings are matched in the text, which detokenize=False leaves out"
            )
        if self.truncate_prompt_tokens is not None:
            name = "truncate_prompt_tokens"
            check_int(name, self.truncate_prompt_tokens, minimum=-1, maximum=2**31 - 1)
            if self.truncate_prompt_tokens == 0:
                raise SamplingParamError(
                    name, f"{name} must be >= 1 or -1 (the model's length), got 0"
                )
        object.__setattr__(self, "bad_words", _bad_words(self.bad_words))
        if self.cache_salt is not None:
            _check_cache_salt(self.cache_salt)
        if self.lora_name is not None and (
            not isinstance(self.lora_name, str) or not self.lora_name
        ):
            raise SamplingParamError(
                "lora_name",
                f"lora_name must be a non-empty string if given, got {self.lora_name!r}",
            )
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise SamplingParamError(
                    "structured_outputs",
                    "structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(self.structured_outputs).__name__}",
                )
            guided = self.structured_outputs.to_guided()
            if self.guided is not None and self.guided != guided:
                raise SamplingParamError(
                    "structured_outputs", "give one of guided and structured_outputs, not both"
                )
            object.__setattr__(self, "guided", guided)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every token id these params name is in ``[0, vocab_size)`` and no more alternatives
        are asked for than the vocabulary has; ``SamplingParamError`` naming the field if not.
        The engine and the gateway's gRPC API (before admission) both check with it."""
        outside = [
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids[-1:]),  # sorted: the largest is last
            ("logit_bias", tuple(token_id for token_id, _ in self.logit_bias)),
        ]
        for name, token_ids in outside:
            for token_id in token_ids:
                if token_id >= vocab_size:
                    raise SamplingParamError(
                        name,
                        f"{name} has token id {token_id}, outside the vocabulary [0, {vocab_size})",
                    )
        for index, word in enumerate(self.bad_words_token_ids):
            if max(word) >= vocab_size:
                raise SamplingParamError(
                    "bad_words_token_ids",
                    f"bad_words_token_ids[{index}] has token id {max(word)}, outside the "
                    f"vocabulary [0, {vocab_size})",
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise SamplingParamError(
                    name, f"{name} must be <= vocab size {vocab_size}, got {value}"
                )

    def bad_words_conflict(self) -> str | None:
        """Why no token could ever be sampled because one-token ``bad_words_token_ids`` ban every
        token of ``allowed_token_ids``, or None. The engine refuses such a request (a node:
        INVALID_ARGUMENT, which the gateway answers as a 400): every logit of the row would be
        -inf, and the sampler would return a token outside ``allowed_token_ids``."""
        singles = self.bad_word_endings[0]
        if self.allowed_token_ids and set(singles).issuperset(self.allowed_token_ids):
            return (
                "bad_words_token_ids ban every token of allowed_token_ids (as words of one "
                "token): no token could be sampled"
            )
        return None

    def min_tokens_conflict(self, eos_token_ids: tuple[int, ...]) -> str | None:
        """Why no token could ever be sampled before ``min_tokens`` (every allowed token that no
        one-token bad word bans is EOS or a stop id, which ``min_tokens`` masks), or None. The
        engine and the gateway refuse such a request: the sampler would have nothing to draw
        from. (Allowed tokens that bad words alone ban: ``bad_words_conflict``.)"""
        if not self.min_tokens or not self.allowed_token_ids:
            return None
        singles = set(self.bad_word_endings[0])
        if set(self.allowed_token_ids) - singles <= {*eos_token_ids, *self.stop_token_ids}:
            held = "EOS or stop token ids"
            if singles.intersection(self.allowed_token_ids):
                held = f"ids that bad_words_token_ids ban, and {held}"
            return (
                f"allowed_token_ids holds only {held}, which min_tokens ({self.min_tokens}) "
                "forbids: no token could be sampled"
            )
        return None

    @functools.cached_property
    def bad_word_endings(self) -> tuple[tuple[int, ...], dict[int, list[tuple[int, ...]]]]:
        """``bad_words_token_ids`` as the sampler looks them up at every step: (the last tokens
        of the one-token sequences, always forbidden; the longer sequences by the token before
        their last, so that a row's step only compares those its output could be completing).
        Cached: the params of a request live as long as it does."""
        singles = tuple(word[0] for word in self.bad_words_token_ids if len(word) == 1)
        longer: dict[int, list[tuple[int, ...]]] = {}
        for word in self.bad_words_token_ids:
            if len(word) > 1:
                longer.setdefault(word[-2], []).append(word)
        return singles, longer

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _token_ids(name: str, token_ids: object) -> tuple[object, ...]:
    """``token_ids`` as a tuple (ids checked by the caller); None is empty, as vLLM's unset."""
    if token_ids is None:
        return ()
    if isinstance(token_ids, (str, bytes, Mapping)) or not isinstance(token_ids, Iterable):
        raise SamplingParamError(name, f"{name} must be a list of token ids, got {token_ids!r}")
    return tuple(token_ids)


def _stop_strings(stop: object) -> tuple[str, ...]:
    """vLLM's ``stop``: one string or a list of them, as a tuple without repeats; None is
    empty. An empty string would match before any text."""
    if stop is None:
        return ()
    listed = [stop] if isinstance(stop, str) else stop
    if isinstance(listed, (bytes, Mapping)) or not isinstance(listed, Iterable):
        raise SamplingParamError("stop", f"stop must be a string or a list of them, got {stop!r}")
    strings = tuple(listed)
    for item in strings:
        if not isinstance(item, str) or not item:
            raise SamplingParamError(
                "stop", f"stop strings must be non-empty strings, got {item!r}"
            )
    return tuple(dict.fromkeys(strings))


def _check_cache_salt(salt: object) -> None:
    if not isinstance(salt, str) or not salt:
        raise SamplingParamError(
            "cache_salt", f"cache_salt must be a non-empty string if given, got {salt!r}"
        )
    try:
        salt.encode("utf-8")  # what the block hashes take
    except UnicodeEncodeError as exc:
        raise SamplingParamError(
            "cache_salt", f"cache_salt is not valid Unicode: a lone surrogate at {exc.start}"
        ) from None


def _bad_words(words: object) -> tuple[str, ...]:
    """vLLM's ``bad_words``: a list of non-empty strings, as a tuple; None is empty."""
    if words is None:
        return ()
    if isinstance(words, (str, bytes, Mapping)) or not isinstance(words, Iterable):
        raise SamplingParamError("bad_words", f"bad_words must be a list of strings, got {words!r}")
    listed = tuple(words)
    for index, word in enumerate(listed):
        if not isinstance(word, str) or not word:
            raise SamplingParamError(
                "bad_words", f"bad_words[{index}] must be a non-empty string, got {word!r}"
            )
    return listed


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` or (id, bias) pairs as pairs sorted by id (one canonical order); the
    ids and values are checked by the caller. None is empty, as vLLM's unset."""
    name = "logit_bias"
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        pairs: list[object] = list(bias.items())
    elif isinstance(bias, (str, bytes)) or not isinstance(bias, Iterable):
        raise SamplingParamError(name, f"{name} must map token ids to biases, got {bias!r}")
    else:
        pairs = list(bias)
    by_id: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise SamplingParamError(
                name,
                f"{name} must map token ids to biases (a dict, or (id, bias) pairs), "
                f"got the entry {pair!r}",
            )
        token_id, value = pair
        check_int(name, token_id, minimum=0)  # before sorting: ids of mixed types do not order
        by_id[cast(int, token_id)] = cast(float, value)  # the value is checked by the caller
    return tuple(sorted(by_id.items()))


def _token_sequences(words: object) -> tuple[tuple[int, ...], ...]:
    """``bad_words_token_ids`` as tuples, each a non-empty sequence of token ids; None is
    empty, like the other lists' unset."""
    name = "bad_words_token_ids"
    if words is None:
        return ()
    if isinstance(words, (str, bytes)) or not isinstance(words, Iterable):
        raise SamplingParamError(name, f"{name} must be a list of token-id lists, got {words!r}")
    sequences = []
    for index, word in enumerate(words):
        if isinstance(word, (str, bytes)) or not isinstance(word, Iterable):
            raise SamplingParamError(name, f"{name}[{index}] must be a list of token ids")
        sequence = tuple(word)
        if not sequence:
            raise SamplingParamError(name, f"{name}[{index}] is empty")
        for token_id in sequence:
            check_int(name, token_id, minimum=0)
        sequences.append(sequence)
    return tuple(sequences)


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    """``SamplingParamError`` naming ``name`` unless ``value`` is an int (not a bool) in range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamError(name, f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise SamplingParamError(name, f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SamplingParamError(name, f"{name} must be <= {maximum}, got {value}")


def check_float(name: str, value: object) -> None:
    """``SamplingParamError`` naming ``name`` unless ``value`` is a finite number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamError(name, f"{name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise SamplingParamError(name, f"{name} must be finite, got {value}")
