"""Offline batch generation, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypedDict, cast

from services.engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SchedulingPolicy,
    default_max_num_batched_tokens,
)
from services.engine.engine_core import EngineCore
from services.engine.outputs import RequestOutput
from services.types import EngineConfigError, SamplingParams


class TokensPrompt(TypedDict):
    """A prompt as vLLM's ``TokensPrompt``: ``{"prompt_token_ids": [...]}`` (no other keys)."""

    prompt_token_ids: Sequence[int]


Prompt = Sequence[int] | TokensPrompt
"""One prompt: its token ids, or vLLM's ``{"prompt_token_ids": [...]}``."""


class LLM:
    """``LLM(model_dir).generate(prompt_token_ids, params)`` over the continuous-batching engine.

    ``model_dir`` is a Hugging Face model directory, a GGUF file, or a directory holding one.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "bfloat16",
        kv_cache_dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        seed: int | None = 0,
        attention_backend: str = "auto",
        cuda_graphs: bool | None = None,
    ) -> None:
        """``max_num_batched_tokens``: None picks ``default_max_num_batched_tokens`` for
        ``device`` (2,048 on a CPU, 16,384 on a GPU). ``seed``: what requests without a seed of
        their own sample from, reproducibly from run to run; None: a fresh seed each time
        (``EngineConfig.seed``). Bad arguments, a model the engine cannot run and a KV cache
        this process cannot allocate raise ``EngineConfigError`` (a ``ValueError``) naming the
        argument."""
        policies = [str(policy) for policy in SchedulingPolicy]
        if scheduling_policy not in policies:
            raise EngineConfigError(
                f"scheduling_policy must be one of {', '.join(policies)}, got {scheduling_policy!r}"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_max_num_batched_tokens(device, offline=True)
        config = EngineConfig(
            model_dir=cast(Path, model_dir),  # converted, or refused naming it, by EngineConfig
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            device=device,
            max_model_len=max_model_len,
            seed=seed,
            attention_backend=attention_backend,
            cuda_graphs=cuda_graphs,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=kv_cache_memory,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                policy=SchedulingPolicy(scheduling_policy),
            ),
        )
        self.engine = EngineCore(config)
        self._ids = itertools.count()

    def generate(
        self,
        prompt_token_ids: Iterable[Prompt] | TokensPrompt,
        params: SamplingParams | Iterable[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts. A prompt is
        a list of token ids or vLLM's ``{"prompt_token_ids": [...]}`` (one such dict alone is
        one prompt); ``params`` is one ``SamplingParams`` for all, or one per prompt."""
        prompts = _prompts(prompt_token_ids)
        params_list = _params(params, len(prompts))
        request_ids = [f"llm-{next(self._ids)}" for _ in prompts]
        # Validate everything before queueing anything, so a bad prompt leaves no work behind.
        for request_id, prompt, request_params in zip(
            request_ids, prompts, params_list, strict=True
        ):
            self.engine.validate_request(request_id, prompt, request_params)
        results = {
            request_id: RequestOutput(
                request_id=request_id,
                prompt_token_ids=[int(t) for t in prompt],
                token_ids=[],
                finish_reason=None,
                logprobs=[] if request_params.logprobs is not None else None,
            )
            for request_id, prompt, request_params in zip(
                request_ids, prompts, params_list, strict=True
            )
        }
        try:
            for request_id, prompt, request_params in zip(
                request_ids, prompts, params_list, strict=True
            ):
                self.engine.add_request(request_id, prompt, request_params)
            pending = len(request_ids)
            while pending:
                for out in self.engine.step():
                    result = results[out.request_id]
                    result.token_ids.extend(out.new_token_ids)
                    if out.new_logprobs is not None and result.logprobs is not None:
                        result.logprobs.extend(out.new_logprobs)
                    result.num_cached_tokens = out.num_cached_tokens
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = out.prompt_logprobs
                        result.prompt_logprob_ranks = out.prompt_logprob_ranks
                    if out.finished:
                        result.finish_reason = out.finish_reason
                        pending -= 1
        finally:
            # An interrupted call (KeyboardInterrupt, an error in the model) leaves nothing queued.
            for request_id, result in results.items():
                if result.finish_reason is None:
                    self.engine.abort(request_id)
        return [results[request_id] for request_id in request_ids]


def _prompts(prompts: object) -> list[Sequence[int]]:
    """The prompts' token ids, one list per prompt (each checked by the engine). vLLM's
    ``TokensPrompt`` dicts give their ``prompt_token_ids``; a dict with other keys is refused,
    since the engine would silently drop what they ask for (text, images, ...)."""
    if isinstance(prompts, Mapping):
        prompts = [prompts]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
        raise ValueError(
            "prompt_token_ids must be a list of prompts, each a list of token ids (or "
            f'{{"prompt_token_ids": [...]}}), got {type(prompts).__name__}'
        )
    token_ids = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, Mapping):
            if set(prompt) != {"prompt_token_ids"}:
                raise ValueError(
                    f"prompt {index} is a dict with the keys {sorted(map(str, prompt))}: the "
                    'engine takes {"prompt_token_ids": [...]} alone (token ids, no text)'
                )
            prompt = prompt["prompt_token_ids"]
        token_ids.append(prompt)
    return token_ids


def _params(params: object, num_prompts: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: ``params`` repeated, or its list (default params for
    None)."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
        raise ValueError(
            f"params must be SamplingParams or a list of them, got {type(params).__name__}"
        )
    listed = list(params)
    for index, item in enumerate(listed):
        if not isinstance(item, SamplingParams):
            raise ValueError(f"params[{index}] must be SamplingParams, got {type(item).__name__}")
    if len(listed) != num_prompts:
        raise ValueError(f"got {len(listed)} SamplingParams for {num_prompts} prompts")
    return listed
