"""Offline batch generation, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from services.engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SchedulingPolicy,
    default_max_num_batched_tokens,
)
from services.engine.engine_core import EngineCore
from services.engine.outputs import RequestOutput
from services.types import SamplingParams


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
        seed: int = 0,
        attention_backend: str = "auto",
        cuda_graphs: bool | None = None,
    ) -> None:
        """``max_num_batched_tokens``: None picks ``default_max_num_batched_tokens`` for
        ``device`` (2,048 on a CPU, 16,384 on a GPU)."""
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_max_num_batched_tokens(device, offline=True)
        config = EngineConfig(
            model_dir=Path(model_dir),
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
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
        if params is None:
            params = SamplingParams()
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
            raise ValueError("prompt_token_ids must be a list of prompts, each a list of token ids")
        if isinstance(params, SamplingParams):
            params = [params] * len(prompt_token_ids)
        if len(params) != len(prompt_token_ids):
            raise ValueError(
                f"got {len(params)} SamplingParams for {len(prompt_token_ids)} prompts"
            )
        request_ids = [f"llm-{next(self._ids)}" for _ in prompt_token_ids]
        # Validate everything before queueing anything, so a bad prompt leaves no work behind.
        for request_id, prompt, request_params in zip(
            request_ids, prompt_token_ids, params, strict=True
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
                request_ids, prompt_token_ids, params, strict=True
            )
        }
        try:
            for request_id, prompt, request_params in zip(
                request_ids, prompt_token_ids, params, strict=True
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
