"""The step-wise engine that nodes drive: ``add_request``, ``step``, ``abort``.

Life cycle: construction loads the model, sizes and allocates the KV cache and builds the
scheduler (a setting or a model it cannot run with raises ``EngineConfigError`` naming the
setting, a model file it cannot read ``ModelFileError`` or ``OSError``; anything else is a bug);
then callers add requests (validated here, so a bad one never reaches the scheduler) and call
``step`` while ``has_work``; ``abort`` removes a request at any point and frees its blocks at
once. Single-threaded: a node runs it in one loop of its own. With LoRA on, ``add_lora`` loads an
adapter before the requests naming it (``SamplingParams.lora_name``) are added, and
``remove_lora`` drops it once none of them is queued or running. ``retire_lora`` (a node's
run-time unload) does not wait for that: the adapter leaves ``lora_names`` at once, so no new
request may name it, and is dropped when the last request of it ends (in a step, or by an
abort); ``add_lora`` of the same files before then takes it back. An embedding request
(``add_request(..., pooling=...)``) ends in the step that computes its last prompt token, with
its vector as its one output (``EngineCoreOutput.embedding``) and no token.

Disaggregated roles use two more entries. A decode node ``reserve``s blocks for a prompt, a
peer writes the prompt's KV into them (``kv_caches`` are the memory to register, ``kv_layout``
says where each block sits), and ``commit`` starts decoding from the peer's first token. A
prefill node adds requests with ``hold_kv=True``: when one stops, its blocks stay until
``release_kv`` (after its pages were pushed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import numbers
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from services.engine.config import EngineConfig, SchedulingPolicy
from services.engine.dtype_choice import (
    choose_compute_dtype,
    choose_kv_cache_dtype,
    model_gemm_shapes,
)
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.kv_layout import KvLayout
from services.engine.model_runner import ModelRunner, check_device
from services.engine.outputs import EngineCoreOutput, EngineStats
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Reservation, SampledToken, Scheduler
from services.engine.speculative import NgramProposer, can_speculate
from services.engine.structured_output import GrammarMatcher, GrammarState, StructuredOutputs
from services.models.config import ModelConfig
from services.models.fp8_checkpoint import read_fp8_checkpoint
from services.models.fp8_linear import choose_fp8_linears
from services.models.gguf_file import find_gguf, open_gguf
from services.models.lora import LoraAdapterError
from services.models.pooling_config import LAST_TOKEN, declared_pooling
from services.types import EngineConfigError, PoolingParams, SamplingParamError, SamplingParams
from services.types.lora_request import LoRARequest

logger = logging.getLogger(__name__)


class LoraCapacityError(ValueError):
    """``max_loras`` adapters are loaded: one must be removed before another loads."""


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        check_device(torch.device(config.device))  # before the model's files are read
        self.config = config
        self.model_config = ModelConfig.from_model_path(config.model_dir, config.hf_overrides)
        self.max_model_len = resolve_max_model_len(self.model_config, config.max_model_len)
        self.structured_outputs = StructuredOutputs(
            config.model_dir,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
        )
        """Grammar matchers of the constrained requests (``SamplingParams.guided``)."""
        self._embedding_refusal, self.normalize_embeddings = _embedding_defaults(
            Path(config.model_dir)
        )
        """Why embedding requests are refused (the checkpoint declares another pooling than
        the last token's), or None; and whether a request that leaves ``normalize`` unset gets
        a normalized embedding (its sentence-transformers modules say, else yes)."""
        gguf_path = find_gguf(config.model_dir)
        fp8_scheme = (
            None
            if gguf_path is not None
            else read_fp8_checkpoint(config.model_dir, config.hf_overrides)
        )
        self.fp8_choice = choose_fp8_linears(
            config.quantization, fp8_scheme, torch.device(config.device)
        )
        """Whether the decoder's projections multiply in fp8 (``fp8_linear.py``)."""
        logger.info("decoder projections compute in %s", self.fp8_choice.describe())
        self.dtype_choice = choose_compute_dtype(
            config.dtype,
            config.device,
            model_gemm_shapes(self.model_config, config.scheduler.max_num_batched_tokens),
            quantized_checkpoint=fp8_scheme is not None
            or (gguf_path is not None and open_gguf(gguf_path).is_quantized),
        )
        """The compute dtype: ``config.dtype`` unless that is ``auto``."""
        logger.info("compute dtype %s", self.dtype_choice.describe())
        self.kv_dtype_choice = choose_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype_choice.dtype, config.device, config.attention_backend
        )
        """The KV cache dtype: ``config.kv_cache_dtype`` unless that is ``auto`` (bfloat16 on
        CPU: decode reads half the bytes; the compute dtype on CUDA)."""
        logger.info("KV cache dtype %s", self.kv_dtype_choice.describe())
        self.runner = ModelRunner(
            self.model_config,
            config,
            dtype=self.dtype_choice.dtype,
            kv_cache_dtype=self.kv_dtype_choice.dtype,
            max_model_len=self.max_model_len,
            structured_outputs=self.structured_outputs,
            fp8_linears=self.fp8_choice.on,
        )
        num_blocks = self.runner.num_blocks_for(config.cache)
        # The pool hands out the first num_usable blocks; the runner keeps the rest (a dummy
        # block for the static decode path's padding rows).
        num_usable = num_blocks - self.runner.num_reserved_blocks
        capacity = num_usable * config.cache.block_size
        if capacity < self.max_model_len:
            raise EngineConfigError(
                f"the KV cache holds {capacity} tokens ({num_usable} blocks), fewer than "
                f"max_model_len={self.max_model_len}: raise kv_cache_memory or lower max_model_len"
            )
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_cache = KVCacheManager(
            num_usable, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache,
            max_model_len=self.max_model_len,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
        )
        config_hash = hashlib.sha256(
            _config_bytes(config.model_dir, config.hf_overrides)
        ).hexdigest()
        self.kv_layout = KvLayout(
            model_id=f"{self.model_config.architecture}:{config_hash[:16]}",
            dtype=self.kv_dtype_choice.dtype,
            block_size=config.cache.block_size,
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            num_blocks=num_blocks,
        )
        """Where each block sits in ``kv_caches``, and the fingerprint peers must match."""
        self.proposer = None if config.speculative is None else NgramProposer(config.speculative)
        """Speculative decoding's proposer (``speculative.py``), or None when it is off."""
        self._retiring_loras: dict[str, float] = {}
        """Adapters ``retire_lora`` unloads once their last request ends, each with the
        ``time.monotonic()`` before which it is kept for ``hold_kv`` requests anyway."""
        for index, (name, path) in enumerate(
            () if config.lora is None else config.lora.lora_modules
        ):
            try:
                self.add_lora(LoRARequest(name, index + 1, path))
            except LoraAdapterError as exc:
                raise EngineConfigError(f"lora_modules {name}={path}: {exc}") from None

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    @property
    def has_work(self) -> bool:
        """``step`` would compute something (reserved requests wait on their peer)."""
        return self.scheduler.has_work

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer."""
        return self.runner.kv_caches

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        hold_kv: bool = False,
        grammar: GrammarMatcher | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queue a request; raises ``ValueError`` naming the field when the input is bad.
        ``grammar``: ``params.guided`` already compiled (``structured_outputs.compile``, off the
        engine thread); None compiles it here. ``pooling``: an embedding request, which ends
        once its prompt is computed, its output's ``embedding`` set and no token sampled
        (``params`` give it its priority, adapter and cache salt)."""
        request = self._make_request(request_id, prompt_token_ids, params, hold_kv)
        if pooling is not None:
            self._check_pooling(params, pooling, hold_kv)
            if pooling.normalize is None:
                pooling = dataclasses.replace(pooling, normalize=self.normalize_embeddings)
            request.pooling = pooling
        else:
            self._check_can_generate()
        if params.guided is not None:
            self.structured_outputs.add(request_id, params.guided, grammar)
        self.scheduler.add_request(request)

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        grammar: GrammarMatcher | None = None,
    ) -> Reservation | None:
        """Decode role: hold blocks for the prompt's KV (the first from the prefix cache, already
        holding it), or None when there is no room (too few free blocks, or ``max_num_seqs``
        requests already running or reserved). ``grammar`` as in ``add_request``."""
        request = self._make_request(request_id, prompt_token_ids, params, hold_kv=False)
        self._check_can_generate()
        if not self.scheduler.can_reserve(request):
            return None
        if params.guided is not None:
            self.structured_outputs.add(request_id, params.guided, grammar)
        return self.scheduler.reserve(request)

    def commit(
        self, request_id: str, first_token_id: int, logprobs: dict[int, float] | None = None
    ) -> EngineCoreOutput:
        """Decode role: the reserved blocks hold the prompt's KV; decode on from the first token.
        Raises ``KeyError`` for a request that is not reserved (aborted, expired, unknown)."""
        if request_id not in self.scheduler.reserved:
            raise KeyError(f"request {request_id!r} holds no reservation")
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise ValueError(
                f"first_token_id {first_token_id} is outside the vocabulary "
                f"[0, {self.model_config.vocab_size})"
            )
        if request_id in self.structured_outputs:
            # The prefill node sampled it under the same grammar: this rebuilds the matcher's
            # state from the tokens so far.
            if not self.structured_outputs.is_allowed(request_id, first_token_id):
                raise ValueError(
                    f"first_token_id {first_token_id} is not allowed by the request's grammar"
                )
            self._accept_grammar_token(self.scheduler.reserved[request_id], first_token_id)
        request = self.scheduler.commit(request_id, SampledToken(first_token_id, logprobs))
        return self._output(request)

    def kv_block_ids(self, request_id: str) -> list[int]:
        """The blocks a live, reserved or held request owns, in token order."""
        return self.kv_cache.block_ids(request_id)

    def release_kv(self, request_id: str) -> bool:
        """Prefill role: free a stopped ``hold_kv`` request's blocks once no peer reads them."""
        return self.scheduler.release_held(request_id) is not None

    def _make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        hold_kv: bool,
    ) -> Request:
        self.validate_request(request_id, prompt_token_ids, params, hold_kv=hold_kv)
        # int(): numpy or torch integer ids become plain ints for hashing and tensor building.
        prompt = [int(token_id) for token_id in prompt_token_ids]
        return Request(request_id, prompt, params, hold_kv=hold_kv)

    def validate_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        hold_kv: bool = False,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.scheduler.requests or request_id in self.scheduler.held:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
            raise ValueError(
                "prompt_token_ids must be a list of token ids (one list per prompt; the engine "
                f"takes no text), got {type(prompt_token_ids).__name__}"
            )
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids is empty: a prompt needs at least one token")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids has {len(prompt_token_ids)} tokens, "
                f"max_model_len is {self.max_model_len}"
            )
        vocab_size = self.model_config.vocab_size
        check_token_ids(prompt_token_ids, vocab_size)
        params.check_vocabulary(vocab_size)
        # What the sampler could not satisfy, refused before any step: it would return a token
        # outside allowed_token_ids.
        conflict = params.bad_words_conflict()
        if conflict is not None:
            raise SamplingParamError("bad_words_token_ids", conflict)
        conflict = params.min_tokens_conflict(tuple(self.model_config.eos_token_ids))
        if conflict is not None:
            raise SamplingParamError("allowed_token_ids", conflict)
        if (
            params.lora_name is not None
            and params.lora_name not in self.lora_names
            # A prefill node's request was reserved on its decode node before an unload.
            and not (hold_kv and params.lora_name in self._retiring_loras)
        ):
            loaded = ", ".join(sorted(self.lora_names)) or "none"
            raise SamplingParamError(
                "lora_name",
                "LoRA is off in this engine: start it with enable_lora"
                if self.config.lora is None
                else f"LoRA adapter {params.lora_name!r} is being unloaded (loaded: {loaded})"
                if params.lora_name in self._retiring_loras
                else f"no LoRA adapter {params.lora_name!r} is loaded (loaded: {loaded})",
            )
        if params.priority != 0 and self.config.scheduler.policy is not SchedulingPolicy.PRIORITY:
            # As vLLM: a priority the scheduler would ignore is refused, not silently dropped.
            raise SamplingParamError(
                "priority",
                f"priority {params.priority} needs the priority scheduling policy "
                f"(--scheduling-policy priority); this engine runs {self.config.scheduler.policy}",
            )

    def _check_can_generate(self) -> None:
        if not self.runner.model.can_generate:
            raise ValueError(
                "this model's checkpoint has no lm_head (an embedding model's): it serves "
                "embeddings only"
            )

    def _check_dimensions(self, dimensions: int) -> None:
        """A shorter embedding only for a model trained to give one (vLLM refuses alike): the
        first values of another model's vector are a poor embedding, not an error anyone sees."""
        hidden_size = self.model_config.hidden_size
        allowed = self.model_config.matryoshka_dimensions
        if allowed is None:
            raise SamplingParamError(
                "dimensions",
                "this model does not support matryoshka representation (its config.json sets "
                "neither is_matryoshka nor matryoshka_dimensions): changing the output "
                "dimensions would give poor embeddings",
            )
        if allowed and dimensions not in allowed:
            raise SamplingParamError(
                "dimensions",
                f"this model supports the matryoshka dimensions {list(allowed)} only, got "
                f"{dimensions}",
            )
        if dimensions > hidden_size:
            raise SamplingParamError(
                "dimensions",
                f"dimensions {dimensions} is above the model's hidden size {hidden_size}",
            )

    def _check_pooling(self, params: SamplingParams, pooling: PoolingParams, hold_kv: bool) -> None:
        if not isinstance(pooling, PoolingParams):
            raise ValueError(f"pooling must be PoolingParams, got {type(pooling).__name__}")
        if self._embedding_refusal is not None:
            raise ValueError(self._embedding_refusal)
        if pooling.dimensions is not None:
            self._check_dimensions(pooling.dimensions)
        for name, wrong in (
            ("hold_kv", hold_kv),
            ("guided", params.guided is not None),
            ("prompt_logprobs", params.prompt_logprobs is not None),
        ):
            if wrong:
                raise SamplingParamError(name, f"an embedding request takes no {name}")

    @property
    def lora_names(self) -> set[str]:
        """The LoRA adapters new requests may name (``add_lora``), by name: those retiring
        (``retire_lora``) are left out."""
        lora = self.runner.lora
        return set() if lora is None else set(lora.adapters) - self._retiring_loras.keys()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load vLLM's ``LoRARequest``'s adapter under its ``lora_name``; False where those
        files are loaded under it already (True where they were being unloaded: kept again).
        ``LoraAdapterError`` for an adapter the engine cannot apply, ``LoraCapacityError`` past
        ``max_loras``, ``ValueError`` with LoRA off or for a name loaded from another path (a
        request of it may be running)."""
        lora = self.config.lora
        if lora is None:
            raise ValueError("LoRA is off in this engine: start it with enable_lora")
        self._reap_retired_loras()
        name, path = lora_request.lora_name, lora_request.path
        loaded = self.runner.lora.adapters if self.runner.lora is not None else {}
        if name in loaded:
            if loaded[name].path != path:
                raise ValueError(
                    f"LoRA adapter {name!r} is loaded from {loaded[name].path}, not {path}: "
                    "remove it first"
                    + (
                        " (it is being unloaded: requests still run with it)"
                        if name in self._retiring_loras
                        else ""
                    )  # fmt: skip
                )
            if name in self._retiring_loras:  # the same files again: keep them after all
                del self._retiring_loras[name]
                return True
            return False
        if len(loaded) >= lora.max_loras:
            raise LoraCapacityError(
                f"max_loras {lora.max_loras} adapters are loaded ({', '.join(sorted(loaded))}): "
                "remove one first"
            )
        adapter = self.runner.add_lora(name, path)
        logger.info("LoRA adapter %r loaded from %s: rank %d, %s", name, path, adapter.rank,
                    ", ".join(adapter.targets))  # fmt: skip
        return True

    def remove_lora(self, name: str) -> bool:
        """Unload adapter ``name``; False where none is loaded under it. Refused while a request
        of it is queued, running or reserved (its KV on its way from a prefill node)."""
        in_use = self._lora_requests(name)
        if in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by request {in_use[0]!r}")
        self._retiring_loras.pop(name, None)
        return self.runner.remove_lora(name)

    def retire_lora(self, name: str, grace_s: float = 0.0) -> int | None:
        """Unload adapter ``name`` once no request uses it; new requests may not name it from
        now on, except for ``grace_s`` ``hold_kv`` ones (a prefill node's: their decode node
        reserved them, naming the adapter, before the unload). Returns how many requests still
        use it (0 and no grace: unloaded now); None where no adapter is loaded under it (or it
        is retiring already)."""
        self._reap_retired_loras()
        if name not in self.lora_names:
            return None
        in_use = len(self._lora_requests(name))
        if in_use or grace_s > 0:
            self._retiring_loras[name] = time.monotonic() + grace_s
            logger.info("LoRA adapter %r: unloading once its %d requests end (grace %.1f s)",
                        name, in_use, grace_s)  # fmt: skip
        else:
            self.runner.remove_lora(name)
            logger.info("LoRA adapter %r unloaded", name)
        return in_use

    def _lora_fingerprints(self) -> tuple[tuple[str, str], ...]:
        lora = self.runner.lora
        if lora is None:
            return ()
        names = sorted(self.lora_names)
        return tuple((name, lora.adapters[name].fingerprint) for name in names)

    def _lora_requests(self, name: str) -> list[str]:
        """The requests of adapter ``name`` queued, running or reserved (their KV on its way)."""
        scheduler = self.scheduler
        return [r.request_id
                for r in (*scheduler.requests.values(), *scheduler.reserved.values())
                if r.params.lora_name == name]  # fmt: skip

    def _reap_retired_loras(self) -> None:
        """Drop each retiring adapter whose grace has passed and whose last request has ended
        (checked after each step and abort, and before each LoRA update: an idle engine keeps
        one, unusable by new requests, until then)."""
        now = time.monotonic()
        for name in [name for name, until in self._retiring_loras.items()
                     if until <= now and not self._lora_requests(name)]:  # fmt: skip
            del self._retiring_loras[name]
            self.runner.remove_lora(name)
            logger.info("LoRA adapter %r unloaded: its last request ended", name)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are free when this returns."""
        request = self.scheduler.abort_request(request_id)
        self.runner.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)
        self.structured_outputs.remove(request_id)
        if self._retiring_loras:
            self._reap_retired_loras()
        return request is not None

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        now = time.monotonic()
        for chunk in scheduler_output.chunks:
            if chunk.request.first_scheduled_time is None:
                chunk.request.first_scheduled_time = now
        sampled, prompt_logprobs, embeddings = self.runner.execute(scheduler_output)
        for request_id, embedding in embeddings.items():
            self.scheduler.requests[request_id].embedding = embedding
        for request_id, entries in prompt_logprobs.items():
            request = self.scheduler.requests[request_id]
            for position, entry, rank in entries:
                request.prompt_logprobs[position] = entry
                request.prompt_logprob_ranks[position] = rank
        if len(self.structured_outputs):
            self._accept_grammar_tokens(sampled)
        updated = self.scheduler.update_from_output(scheduler_output, sampled)
        if self._retiring_loras:
            self._reap_retired_loras()
        outputs = [self._output(request) for request in updated]
        if self.proposer is not None:
            self._propose(self.proposer)
        return outputs

    def _propose(self, proposer: NgramProposer) -> None:
        """Proposals for the next step of each running request that decodes and may speculate,
        no more than its ``max_tokens`` and the model's length leave room for; none while the
        batch is larger than ``disable_by_batch_size``."""
        running = self.scheduler.running
        limit = proposer.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            for request in running:
                request.draft_token_ids = []
            return
        for request in running:
            if (
                request.num_tokens - request.num_computed_tokens != 1
                or not request.output_token_ids
                or not can_speculate(request.params)
            ):
                continue
            room = min(
                request.params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens,
            )
            request.draft_token_ids = proposer.propose(request.request_id, request.token_ids, room)

    def _accept_grammar_tokens(self, sampled: Mapping[str, Sequence[SampledToken]]) -> None:
        """Advance the matchers over this step's tokens; a complete grammar stops its request,
        a failed one ends it with ``error``. (A constrained request gets one token a step: it
        never speculates.)"""
        for request_id, tokens in sampled.items():
            if request_id in self.structured_outputs:
                for token in tokens:
                    self._accept_grammar_token(self.scheduler.requests[request_id], token.token_id)

    def _accept_grammar_token(self, request: Request, token_id: int) -> None:
        state = self.structured_outputs.accept(request.request_id, token_id)
        if state is GrammarState.COMPLETE:
            request.is_grammar_complete = True
        elif state is GrammarState.FAILED:
            request.grammar_error = self.structured_outputs.error(request.request_id)

    def _output(self, request: Request) -> EngineCoreOutput:
        """The request's latest token as a delta; drops its sampling state once it stopped.
        A failed request's last token, the one its grammar could not take, is not handed out."""
        finish_reason = request.finish_reason
        if finish_reason is not None:
            self.runner.release(request.request_id)
            self.structured_outputs.remove(request.request_id)
            if self.proposer is not None:
                self.proposer.release(request.request_id)
        # The tokens this step added: one, or several where proposals were kept.
        new = slice(request.num_emitted_tokens, None)
        request.num_emitted_tokens = len(request.output_token_ids)
        is_failed = request.status is RequestStatus.FINISHED_ERROR
        has_prompt_logprobs = (
            request.num_output_tokens == 1 and request.params.prompt_logprobs is not None
        )
        return EngineCoreOutput(
            prompt_logprobs=list(request.prompt_logprobs) if has_prompt_logprobs else None,
            prompt_logprob_ranks=(
                list(request.prompt_logprob_ranks) if has_prompt_logprobs else None
            ),
            request_id=request.request_id,
            new_token_ids=[] if is_failed else request.output_token_ids[new],
            new_logprobs=(
                ([] if is_failed else request.output_logprobs[new])
                if request.params.logprobs is not None
                else None
            ),
            new_logprob_ranks=(
                ([] if is_failed else request.output_logprob_ranks[new])
                if request.params.logprobs is not None
                else None
            ),
            finish_reason=finish_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_time=request.first_scheduled_time,
            error=request.grammar_error if is_failed else None,
            embedding=request.embedding,
        )

    def stats(self) -> EngineStats:
        prefix = self.kv_cache.prefix_cache_stats
        lora = self.config.lora
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_reserved=len(self.scheduler.reserved),
            num_held=len(self.scheduler.held),
            num_blocks_used=self.kv_cache.pool.num_used_blocks,
            num_blocks_total=self.kv_cache.num_blocks,
            prefix_cache_queried_tokens=prefix.num_queried_tokens,
            prefix_cache_hit_tokens=prefix.num_hit_tokens,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_draft_tokens_total=self.scheduler.num_draft_tokens_total,
            num_accepted_tokens_total=self.scheduler.num_accepted_tokens_total,
            lora_fingerprints=self._lora_fingerprints(),
            lora_running=_adapters(self.scheduler.running) if lora is not None else (),
            lora_waiting=_adapters(self.scheduler.waiting) if lora is not None else (),
            max_loras=lora.max_loras if lora is not None else 0,
        )


def _adapters(requests: Iterable[Request]) -> tuple[str, ...]:
    """The LoRA adapters ``requests`` run with, sorted."""
    return tuple(sorted({r.params.lora_name for r in requests if r.params.lora_name}))


def resolve_max_model_len(model_config: ModelConfig, requested: int | None) -> int:
    limit = model_config.max_position_embeddings
    if model_config.sliding_window is not None and model_config.sliding_window < limit:
        # The torch attention path attends to the whole context; within the window that is
        # exactly sliding-window attention, so cap the length rather than compute it wrongly.
        logger.warning(
            "model uses sliding_window=%d: capping max_model_len to it", model_config.sliding_window
        )
        limit = model_config.sliding_window
    if requested is None:
        return limit
    if requested > limit:
        raise EngineConfigError(
            f"max_model_len={requested} exceeds what the model supports ({limit}: "
            "max_position_embeddings, or the sliding window)"
        )
    return requested


def _config_bytes(model_path: Path, overrides: Mapping[str, Any] | None) -> bytes:
    """What the KV layout's model id hashes: config.json, or a GGUF file's metadata as one, and
    the overrides of its values (sorted JSON) where there are any."""
    gguf_path = find_gguf(model_path)
    if gguf_path is None:
        raw = (model_path / "config.json").read_bytes()
    else:
        raw = open_gguf(gguf_path).config_json().encode()
    if not overrides:
        return raw
    return raw + b"\nhf_overrides=" + json.dumps(overrides, sort_keys=True).encode()


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """ValueError naming the first id that is not an integer in [0, vocab_size) (none for no
    ids: the caller refuses an empty prompt with its own message).

    A list of plain ints in range, the common case, is checked without a Python step per id:
    the per-id loop (an abc ``isinstance`` each) took ~1 ms for a 512-token prompt, a fifth of
    an offline GPU run's host time on an H200."""
    if (
        len(token_ids)
        and all(type(t) is int for t in token_ids)
        and 0 <= min(token_ids) <= max(token_ids) < vocab_size
    ):
        return
    for index, token_id in enumerate(token_ids):
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise ValueError(f"prompt_token_ids[{index}] is not an integer: {token_id!r}")
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"prompt_token_ids[{index}] = {token_id} is outside the vocabulary "
                f"[0, {vocab_size})"
            )


def _embedding_defaults(model_dir: Path) -> tuple[str | None, bool]:
    """Why this checkpoint's embeddings are refused (it declares a sentence-transformers
    pooling other than the last token's, which is all the engine pools: ``pooler.py``), or
    None; and whether its embeddings are normalized by default."""
    try:
        declared = declared_pooling(model_dir)
    except ValueError as exc:
        return f"this model's pooling cannot be read ({exc}): embeddings are refused", True
    if declared is None:
        return None, True
    if declared.mode is None or declared.mode == LAST_TOKEN:
        return None, declared.normalize
    return (
        f"this model declares {declared.mode} pooling ({declared.file}); pdserve pools the "
        "last token only, so its embeddings would not be the model's: embeddings are refused"
    ), declared.normalize
