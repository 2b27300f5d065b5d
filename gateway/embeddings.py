"""The embeddings pipeline both APIs run (``/v1/embeddings``, gRPC ``GatewayService/Embed``),
after their own checks and inside an admission slot: inputs → token ids (tokenized off the event
loop, left-truncated, checked against the vocabulary and ``max_model_len``: 400 naming the
field) → the key charged their tokens → every input sent at once to the ``Embedder`` → the
vectors in input order. The first input a node refuses fails the request and cancels the other
inputs' node calls; so does the deadline (504)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from gateway.embedding import Embedding, EmbeddingRequest
from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.frontend import Frontend
from gateway.key_limiter import current_lease
from gateway.limits import check_prompt_ids
from gateway.text.tokenizer import Tokenizer
from services.types import PoolingParams

MAX_INPUTS = 2048
"""Inputs one request may carry (OpenAI's limit)."""


async def embedding_prompts(
    inputs: Sequence[str] | Sequence[Sequence[int]],
    frontend: Frontend,
    *,
    add_special_tokens: bool,
    keep: int | None,
    param: str,
) -> list[tuple[int, ...]]:
    """Each input's token ids (text tokenized in a thread), its last ``keep`` only where
    given; refused naming ``param`` when empty, outside the vocabulary or too long."""
    if not inputs:
        raise invalid(f"{param} must hold at least one input", param=param)
    if len(inputs) > MAX_INPUTS:
        raise invalid(f"{param} holds {len(inputs)} inputs; at most {MAX_INPUTS}", param=param)
    prompts = await asyncio.to_thread(_token_ids, inputs, frontend.tokenizer, add_special_tokens)
    if keep is not None:
        prompts = [ids[-keep:] for ids in prompts]
    check_prompt_ids(prompts, frontend.tokenizer.vocab_size, param)
    max_model_len = frontend.limits.max_model_len
    for index, ids in enumerate(prompts):
        where = param if len(prompts) == 1 else f"{param}[{index}]"
        if len(ids) > max_model_len:
            raise invalid(
                f"{where} has {len(ids)} tokens; this model's maximum context length is "
                f"{max_model_len} (truncate_prompt_tokens keeps the last ones)",
                param=param,
            )
    return [tuple(ids) for ids in prompts]


def _token_ids(
    inputs: Sequence[str] | Sequence[Sequence[int]], tokenizer: Tokenizer, special: bool
) -> list[list[int]]:
    return [
        tokenizer.encode(item, special) if isinstance(item, str) else list(item) for item in inputs
    ]


async def embed_all(
    frontend: Frontend,
    prompts: list[tuple[int, ...]],
    *,
    request_id: str,
    pooling: PoolingParams,
    priority: int,
    lora_name: str | None,
    deadline: float | None,
) -> list[Embedding]:
    """Every prompt's embedding, in order; the key charged their tokens first."""
    embedder = frontend.embedder
    if embedder is None:
        raise GatewayError(ErrorKind.NOT_FOUND, "this server does not serve embeddings")
    num_tokens = sum(map(len, prompts))
    lease = current_lease()
    if lease is not None:
        lease.add_tokens(num_tokens)
    frontend.metrics.prompt_tokens.inc(num_tokens)
    requests = [
        EmbeddingRequest(
            request_id=f"{request_id}-{index}" if len(prompts) > 1 else request_id,
            prompt_token_ids=prompt,
            pooling=pooling,
            priority=priority,
            lora_name=lora_name,
            deadline=deadline,
        )
        for index, prompt in enumerate(prompts)
    ]
    try:
        async with asyncio.timeout_at(_loop_time(deadline)):
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(embedder.embed(request)) for request in requests]
    except TimeoutError:
        raise GatewayError(ErrorKind.DEADLINE_EXCEEDED, "the request deadline passed") from None
    except ExceptionGroup as failed:  # the first failure is the answer
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


def _loop_time(deadline: float | None) -> float | None:
    """``deadline`` (``time.monotonic()``) on the event loop's clock, for ``timeout_at``."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
