"""Turns a ``SchedulerOutput`` into model inputs, runs the model and samples.

Life cycle: ``load`` the weights, size the KV cache (``num_blocks_for``), ``allocate_kv_cache``
once (which also sets up the static decode path and captures its CUDA graphs), then ``execute``
every step; ``release`` drops a finished request's sampling state. With LoRA on
(``EngineConfig.lora``), the projections are wrapped at load (``models/lora.py``), ``add_lora``
/ ``remove_lora`` load and drop adapters between steps, and each step sets each row's adapter
slot for the forward pass only (a replayed decode graph reads them from its static inputs).
"""

from __future__ import annotations

import itertools
import logging
import re
from pathlib import Path

import torch

from services.engine.config import FP8_KV_DTYPE, CacheConfig, EngineConfig
from services.engine.dtype_choice import choose_kv_cache_dtype
from services.engine.gpu_memory import (
    CudaMemoryReader,
    MemoryReader,
    check_kv_cache_fits,
    kv_cache_budget,
)
from services.engine.pooler import pool_last_tokens
from services.engine.request import Request
from services.engine.sampler import Sampler, SamplingMetadata, collect_logprobs
from services.engine.scheduler import SampledToken, ScheduledChunk, SchedulerOutput
from services.engine.speculative import num_accepted, verify_rows
from services.engine.static_decode import StaticDecode
from services.engine.structured_output import StructuredOutputs
from services.host_memory import advise_huge_pages, keep_freed_memory_mapped
from services.models.attention import AttentionMetadata, PrefillSpan, TorchPagedAttention
from services.models.backends import make_attention_backend, make_layer_ops
from services.models.config import ModelConfig
from services.models.loader import load_model
from services.models.lora import LoraAdapter, LoraState, install_lora, load_adapter
from services.models.packed_linear import pack_linears
from services.models.prefill_kernel_choice import choose_prefill_kernel, prefill_kernel_timer
from services.types import EngineConfigError, PoolingParams

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
# Clears a backend's per-step state after the profiling step.
_NO_STEP = AttentionMetadata(
    slot_mapping=torch.zeros(0, dtype=torch.int64),
    num_decodes=0,
    decode_block_tables=torch.zeros(0, 0, dtype=torch.int64),
    decode_seq_lens=torch.zeros(0, dtype=torch.int64),
    prefills=[],
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, FP8_KV_DTYPE: torch.float8_e5m2}


PromptLogprobs = list[tuple[int, dict[int, float], int]]
"""(prompt position, {the prompt token there: its logprob, plus the top-n ids}, that token's rank
in the vocabulary) triples."""

_PROMPT_LOGPROB_ROWS = 256
"""Rows whose logits one slice of a prompt-logprobs chunk holds at once."""

MAX_STATIC_DECODE_BATCH = 512
"""The static decode path's largest batch (vLLM's largest CUDA graph batch by default). Its
buffers, and on a GPU its graphs, come one bucket per 16 requests: sized by ``max_num_seqs``
alone, 10**7 took 25 s and 1.3 GB on a CPU, and a GPU would capture 625,000 graphs. Larger
decode batches run the dynamic path."""


def check_device(device: torch.device) -> None:
    """EngineConfigError naming ``device`` when this process cannot use it. Without it torch fails
    deep in the weights' load, with an error that names no argument (an ``AssertionError`` from
    a CPU-only build, an ``AttributeError`` from ``set_device``)."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise EngineConfigError(f"device {str(device)!r}: CUDA is not available ({why})")
    num_gpus = torch.cuda.device_count()
    if device.index is not None and device.index >= num_gpus:
        raise EngineConfigError(
            f"device {str(device)!r}: CUDA sees {num_gpus} GPU(s), numbered from 0"
        )


def use_device(device: torch.device) -> None:
    """Makes ``device`` (``cuda:N``) this thread's current CUDA device. CUDA graphs, streams and
    events are made on the current device, and Triton launches its kernels there, whatever
    device the tensors are on: a node on ``cuda:1`` (a topology's ``gpu_ids``) would capture its
    graphs and record its events on GPU 0. Per thread: the runner calls it where it is built,
    which is the thread that steps it (``AsyncEngine``'s engine thread, or ``LLM``'s caller)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        *,
        max_model_len: int,
        dtype: str | None = None,
        kv_cache_dtype: str | None = None,
        structured_outputs: StructuredOutputs | None = None,
        fp8_linears: bool = False,
    ) -> None:
        """``dtype``: the resolved compute dtype (default ``config.dtype``, which must then not
        be ``auto``; ``EngineCore`` resolves it with ``dtype_choice``). ``kv_cache_dtype``: the
        resolved dtype the KV cache holds (default ``config.kv_cache_dtype``, resolved with
        ``dtype_choice.choose_kv_cache_dtype`` when ``auto``). ``fp8_linears``: the decoder's
        projections hold fp8 weights (``fp8_linear.choose_fp8_linears`` decides)."""
        keep_freed_memory_mapped()
        if model_config.is_moe:
            check_moe_settings(model_config, config, fp8_linears=fp8_linears)
        if model_config.hidden_act != "silu" and config.lora is not None:
            raise EngineConfigError(
                f"enable_lora: LoRA on {model_config.architecture}'s GELU-gated MLP is not built"
            )
        self.structured_outputs = structured_outputs
        """Grammar matchers of constrained requests: their rows get a token bitmask."""
        self.model_config = model_config
        self.device = torch.device(config.device)
        check_device(self.device)
        use_device(self.device)
        dtype = dtype if dtype is not None else config.dtype
        if dtype not in _DTYPES:
            raise ValueError(f"ModelRunner needs a resolved dtype, got {dtype!r}")
        self.dtype = _DTYPES[dtype]
        if kv_cache_dtype is None:
            kv_cache_dtype = choose_kv_cache_dtype(
                config.kv_cache_dtype, dtype, config.device, config.attention_backend
            ).dtype
        if kv_cache_dtype not in _KV_DTYPES:
            raise ValueError(f"ModelRunner needs a resolved kv_cache_dtype, got {kv_cache_dtype!r}")
        self.kv_cache_dtype = _KV_DTYPES[kv_cache_dtype]
        """The dtype of every layer's cache; attention casts K/V to and from the compute dtype."""
        self.block_size = config.cache.block_size
        self.backend = make_attention_backend(
            config.attention_backend,
            self.device,
            block_size=config.cache.block_size,
            scale=model_config.attention_scale,
        )
        if model_config.sliding_layers and not isinstance(self.backend, TorchPagedAttention):
            raise EngineConfigError(
                f"attention_backend: {model_config.architecture}'s sliding-window layers run "
                "on the torch and native (CPU) backends only, not on "
                f"{type(self.backend).__name__}"
            )
        if model_config.attn_logit_softcapping is not None and not isinstance(
            self.backend, TorchPagedAttention
        ):
            raise EngineConfigError(
                f"attention_backend: {model_config.architecture}'s soft-capped attention runs "
                f"on the torch path only, not on {type(self.backend).__name__}"
            )
        ops = make_layer_ops(self.backend)
        logger.info("decoder elementwise steps: %s", ops.describe())
        self.model = load_model(
            config.model_dir,
            model_config,
            dtype=self.dtype,
            device=self.device,
            max_positions=max_model_len,
            backend=self.backend,
            ops=ops,
            fp8_linears=fp8_linears,
        )
        # CPU bf16 and fp32: weights in oneDNN's blocked layout, packed once (packed_linear.py).
        pack_linears(
            self.model,
            self.device,
            self.dtype,
            silu_gate_up=model_config.hidden_act == "silu",
        )
        self.lora: LoraState | None = None
        """The adapters in their slots, and each step's mask of them, where ``config.lora``
        turned LoRA on."""
        self.max_lora_rank = 0 if config.lora is None else config.lora.max_lora_rank
        if config.lora is not None:
            self.lora = LoraState(
                config.lora.max_loras, self.max_lora_rank, self.dtype, self.device
            )
            install_lora(self.model, model_config, self.lora, ops)
        self.sampler = Sampler(model_config.eos_token_ids, ops.greedy_argmax)
        self.kv_caches: list[torch.Tensor] = []
        self.max_model_len = max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        speculative = config.speculative
        self.max_decode_rows = self.max_num_seqs * (
            1 + (speculative.num_speculative_tokens if speculative is not None else 0)
        )
        """A decode step's rows at most: one per request, and one per proposal it verifies."""
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        if isinstance(self.backend, TorchPagedAttention) and self.device.type == "cpu":
            self._choose_prefill_kernel(self.backend)
        # Default: graphs on CUDA where the backend does not pay for the fixed table width.
        # With LoRA too: the graphs read each row's adapter slot from their static inputs. Not
        # for a mixture of experts, whose step picks its experts on the host.
        self.use_static_decode = (
            config.cuda_graphs
            if config.cuda_graphs is not None
            else self.device.type == "cuda"
            and self.backend.reads_only_context_blocks
            and not model_config.is_moe
        )
        self.static_decode: StaticDecode | None = None
        # On the device: the draws are made where the logits are (_inverse_cdf).
        self._shared_generator = torch.Generator(device=self.device)
        """What the rows of requests without a seed of their own draw from (``config.seed``);
        torch's global generator would make them follow whatever else the process draws."""
        if config.seed is None:
            self._shared_generator.seed()  # from the OS: differs from engine to engine
        else:
            self._shared_generator.manual_seed(config.seed)
        self._generators: dict[str, torch.Generator] = {}
        """Per request with a seed: its own generator, so its tokens do not depend on the batch."""

    def _choose_prefill_kernel(self, backend: TorchPagedAttention) -> None:
        """Times the backend's prefill attention kernels on this CPU at this model's heads (a
        step's budget as 8 chunks of up to 256 tokens, and one chunk of up to 1,024) and keeps
        the fastest; see prefill_kernel_choice.py."""
        cfg = self.model_config
        budget = self.max_num_batched_tokens
        timer = prefill_kernel_timer(
            backend,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            cache_dtype=self.kv_cache_dtype,
            steps=((8, min(256, max(16, budget // 8))), (1, min(1024, budget))),
        )
        choice = choose_prefill_kernel(backend, self.device, timer)
        logger.info("prefill attention: %s", choice.describe())

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (keys and values)."""
        cfg = self.model_config
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
        return per_token * self.block_size * self.kv_cache_dtype.itemsize

    def num_blocks_for(self, cache: CacheConfig, reader: MemoryReader | None = None) -> int:
        """KV blocks to allocate: ``kv_cache_memory`` if set (on CUDA, if it fits in the free
        memory); on CUDA what a profiling step
        leaves of ``gpu_memory_utilization`` (``gpu_memory.py``); 1 GiB on CPU."""
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
            if self.device.type == "cuda" or reader is not None:
                check_kv_cache_fits(budget, (reader or CudaMemoryReader(self.device)).snapshot())
        elif self.device.type == "cuda" or reader is not None:
            reader = reader or CudaMemoryReader(self.device)
            reader.reset_peak()
            try:
                self.profile_run()
            except torch.OutOfMemoryError as exc:
                # The step the scheduler may issue at its largest does not fit, KV cache or not.
                raise EngineConfigError(
                    f"max_num_batched_tokens={self.max_num_batched_tokens}: the profiling step "
                    f"(the largest step the engine may run) ran out of memory on {self.device} "
                    f"({_first_line(exc)}); lower max_num_batched_tokens"
                ) from exc
            budget = kv_cache_budget(reader.snapshot(), cache.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise EngineConfigError(
                f"kv_cache_memory of {budget} bytes holds no KV block "
                f"(one block of {self.block_size} tokens takes {self.block_bytes} bytes)"
            )
        return num_blocks

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The heaviest step the scheduler can issue: ``max_num_batched_tokens`` prompt tokens
        (chunks of at most ``max_model_len``) on a scratch KV cache, plus the logits of up to
        ``max_decode_rows`` samples. Run before the real cache exists, to measure peak memory."""
        cfg, size = self.model_config, self.block_size
        num_tokens = self.max_num_batched_tokens
        spans: list[PrefillSpan] = []
        position_parts = []
        num_blocks = 0
        for start in range(0, num_tokens, self.max_model_len):
            n = min(self.max_model_len, num_tokens - start)
            blocks = -(-n // size)
            block_ids = torch.arange(num_blocks, num_blocks + blocks, device=self.device)
            spans.append(PrefillSpan(start, n, 0, block_ids))
            position_parts.append(torch.arange(n, device=self.device))
            num_blocks += blocks
        positions = torch.cat(position_parts)
        slot_mapping = torch.cat(
            [
                (s.block_ids[:, None] * size + torch.arange(size, device=self.device)).view(-1)[
                    : s.num_tokens
                ]
                for s in spans
            ]
        )
        shape = (2, num_blocks, size, cfg.num_kv_heads, cfg.head_dim)
        scratch = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            for _ in range(cfg.num_layers)
        ]
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decodes=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int64, device=self.device),
            decode_seq_lens=torch.zeros(0, dtype=torch.int64, device=self.device),
            prefills=spans,
        )
        self.backend.prepare(metadata)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, positions, scratch, metadata)
        self.model.compute_logits(hidden[: min(self.max_decode_rows, num_tokens)])
        self.backend.prepare(_NO_STEP)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks of the cache the block pool must not hand out: the static decode path's
        dummy block (the last one), where padding rows write."""
        return 1 if self.use_static_decode else 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache per layer; an
        ``EngineConfigError`` naming the memory settings when this process cannot get them (a
        ``ulimit -v``, another process holding the GPU), with nothing of it kept."""
        cfg = self.model_config
        shape = (2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # Every layer's cache is allocated before any is zeroed: a failed allocation has then
        # touched no page (a large CPU allocation is mapped, not backed, until written).
        caches: list[torch.Tensor] = []
        try:
            for _ in range(cfg.num_layers):
                caches.append(torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device))
        except (RuntimeError, MemoryError) as exc:
            if not _is_allocation_failure(exc):
                raise
            caches.clear()  # freed before the caller hears of it: it may retry smaller
            raise kv_cache_allocation_error(
                exc,
                num_bytes=num_blocks * self.block_bytes,
                num_blocks=num_blocks,
                device=self.device,
            ) from exc
        for cache in caches:
            if self.device.type == "cpu":
                advise_huge_pages(cache.data_ptr(), cache.nbytes)
            # Zeroed so that padding slots read by masked attention hold no NaN bit patterns.
            cache.zero_()
        self.kv_caches = caches
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            num_blocks * self.block_bytes / 2**20,
        )
        if self.use_static_decode:
            self.static_decode = StaticDecode(
                self.model,
                self.backend,
                self.kv_caches,
                max_num_seqs=min(self.max_decode_rows, MAX_STATIC_DECODE_BATCH),
                max_model_len=self.max_model_len,
                block_size=self.block_size,
                dummy_block=num_blocks - 1,
                use_graphs=self.device.type == "cuda",
                lora=self.lora,
            )
            self.static_decode.capture()

    def add_lora(self, name: str, path: Path) -> LoraAdapter:
        """Load the PEFT adapter at ``path`` as ``name`` (replacing one of that name);
        ``LoraAdapterError`` naming what it cannot apply."""
        if self.lora is None:
            raise ValueError("LoRA is off in this engine: start it with enable_lora")
        # Read on the CPU: the slots on the device are the only copy there.
        adapter = load_adapter(
            path,
            self.model_config,
            max_rank=self.max_lora_rank,
            dtype=self.dtype,
            device=torch.device("cpu"),
        )
        self.lora.add(name, adapter)
        return adapter

    def remove_lora(self, name: str) -> bool:
        """Drop the adapter ``name``; False where none is loaded under it."""
        return self.lora is not None and self.lora.remove(name)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput
    ) -> tuple[dict[str, list[SampledToken]], dict[str, PromptLogprobs], dict[str, list[float]]]:
        """The step's sampled tokens (one per sampling chunk; with proposals, the kept ones and
        the sample after them: ``speculative.py``), the prompt logprobs of the chunks that asked
        for them, and the embeddings of the pooling requests whose prompt this step
        completed."""
        # A chunk with proposals runs as decode rows, one per token (``decode_rows``): each row
        # then attends as a plain decode step of its position would, in the same kernel, so a
        # greedy request keeps the tokens it would produce without them.
        decodes = [c for c in output.chunks if c.num_tokens == 1 or c.draft_token_ids]
        prefills = [c for c in output.chunks if c.num_tokens > 1 and not c.draft_token_ids]
        rows_of_decodes = decode_rows(decodes)
        static = self.static_decode
        spans: list[PrefillSpan] = []
        if (
            static is not None
            and decodes
            and not prefills
            and static.bucket_for(len(rows_of_decodes)) is not None
        ):
            hidden = self._run_static(static, rows_of_decodes)
        else:
            input_ids, positions, metadata = self._prepare_inputs(rows_of_decodes, prefills)
            self.backend.prepare(metadata)
            spans = metadata.prefills
            if self.lora is None:
                hidden = self.model(input_ids, positions, self.kv_caches, metadata)
            else:
                row_slots = _lora_row_slots(
                    self.lora, rows_of_decodes, prefills, spans, self.device
                )
                with self.lora.step(row_slots):
                    hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        # hidden: [num_tokens, hidden_size]; the decodes' rows first (a chunk's in a row), then
        # each prefill span's.
        decode_ends = list(itertools.accumulate(chunk.num_tokens for chunk in decodes))
        prompt_logprobs: dict[str, PromptLogprobs] = {}
        if any(chunk.request.needs_prompt_logprobs for chunk in output.chunks):
            first_rows = [
                *(end - chunk.num_tokens for end, chunk in zip(decode_ends, decodes, strict=True)),
                *(span.token_start for span in spans),
            ]
            prompt_logprobs = {
                chunk.request.request_id: self._prompt_logprobs(hidden, chunk, first_row)
                for chunk, first_row in zip([*decodes, *prefills], first_rows, strict=True)
                if chunk.request.needs_prompt_logprobs
            }

        sampled_chunks: list[ScheduledChunk] = []
        rows: list[int] = []
        pooled: list[tuple[str, int, PoolingParams]] = []  # (request id, row, its params)
        last_rows = [*(end - 1 for end in decode_ends),
                     *(span.token_start + span.num_tokens - 1 for span in spans)]  # fmt: skip
        for row, chunk in zip(last_rows, [*decodes, *prefills], strict=True):
            if not chunk.needs_sample:
                continue
            if chunk.request.pooling is not None:
                pooled.append((chunk.request.request_id, row, chunk.request.pooling))
            else:
                sampled_chunks.append(chunk)
                # A chunk with proposals samples at its last token's position and each
                # proposal's: rows [row - len(drafts), row].
                rows.extend(range(row - len(chunk.draft_token_ids), row + 1))
        embeddings: dict[str, list[float]] = {}
        if pooled:
            # final: [num_pooled, hidden_size], the rows after the final norm
            final = self.model.final_hidden(
                hidden[torch.tensor([row for _, row, _ in pooled], device=self.device)]
            )
            vectors = pool_last_tokens(final, [pooling for _, _, pooling in pooled])
            embeddings = {rid: v for (rid, _, _), v in zip(pooled, vectors, strict=True)}
        if not rows:
            return {}, prompt_logprobs, embeddings
        # logits: [num_sampled, vocab_size], the model's dtype
        if rows == list(range(len(rows))):
            selected = hidden[: len(rows)]  # every decode samples: no index to copy over
        else:
            selected = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(selected)
        # One entry per row: a chunk with proposals repeats its request, and each of its rows
        # sees the proposals before it as outputs (penalties, min_tokens, bad words).
        speculating = any(chunk.draft_token_ids for chunk in sampled_chunks)
        requests: list[Request] = [chunk.request for chunk in sampled_chunks]
        outputs: list[list[int]] = [request.output_token_ids for request in requests]
        if speculating:
            requests, outputs = [], []
            for chunk in sampled_chunks:
                request = chunk.request
                row_outputs = verify_rows(request.output_token_ids, chunk.draft_token_ids)
                requests.extend([request] * len(row_outputs))
                outputs.extend(row_outputs)
        structured = self.structured_outputs
        grammar = (
            None if structured is None else structured.bitmask([r.request_id for r in requests])
        )
        result = self.sampler(
            logits,
            SamplingMetadata(
                params=[r.params for r in requests],
                prompt_token_ids=[r.prompt_token_ids for r in requests],
                output_token_ids=outputs,
                generators=[self._generator(r) for r in requests],
                shared_generator=self._shared_generator,
                grammar_bitmask=None if grammar is None else grammar[0],
                grammar_rows=() if grammar is None else tuple(grammar[1]),
            ),
        )
        if not speculating:
            return (
                {
                    request.request_id: [SampledToken(token_id, logprobs, rank)]
                    for request, token_id, logprobs, rank in zip(
                        requests, result.token_ids, result.logprobs, result.ranks, strict=True
                    )
                },
                prompt_logprobs,
                embeddings,
            )
        sampled: dict[str, list[SampledToken]] = {}
        row = 0
        for chunk in sampled_chunks:
            drafts = chunk.draft_token_ids
            end = row + len(drafts) + 1
            kept = num_accepted(drafts, result.token_ids[row:end])
            sampled[chunk.request.request_id] = [
                SampledToken(result.token_ids[i], result.logprobs[i], result.ranks[i])
                for i in range(row, row + kept + 1)
            ]
            row = end
        return sampled, prompt_logprobs, embeddings

    def _prompt_logprobs(
        self, hidden: torch.Tensor, chunk: ScheduledChunk, first_row: int
    ) -> PromptLogprobs:
        """(position, {prompt token at position: logprob, plus the top-n ids}, its rank) for each
        prompt token this chunk predicts: the chunk's row for position p gives token p + 1's."""
        request = chunk.request
        num_top = request.params.prompt_logprobs or 0
        begin = chunk.start_position
        end = min(begin + chunk.num_tokens, request.num_prompt_tokens - 1)  # predicting rows
        entries: PromptLogprobs = []
        # Slices of rows: [rows, vocab_size] fp32 logprobs would be 400 MB at 2,048 rows of a
        # 49k vocabulary.
        for start in range(begin, end, _PROMPT_LOGPROB_ROWS):
            stop = min(start + _PROMPT_LOGPROB_ROWS, end)
            rows = hidden[first_row + start - begin : first_row + stop - begin]
            logprobs = self.model.compute_logits(rows).float().log_softmax(dim=-1)
            targets = request.prompt_token_ids[start + 1 : stop + 1]
            rows_entries, ranks = collect_logprobs(
                logprobs,
                torch.tensor(targets, device=logprobs.device),
                [num_top] * len(targets),
            )
            for offset, (entry, rank) in enumerate(zip(rows_entries, ranks, strict=True)):
                entries.append((start + offset + 1, entry, rank))
        return entries

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.params.seed
        if seed is None:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            if not request.params.is_greedy:
                # A committed request's first token was drawn on the prefill node from the same
                # seed: skip the draws already made (one per token, as _inverse_cdf makes them),
                # so a seeded request samples the same tokens disaggregated and colocated.
                draw = torch.empty(1, dtype=torch.float64, device=self.device)
                for _ in range(request.num_output_tokens):
                    draw.uniform_(generator=generator)
            self._generators[request.request_id] = generator
        return generator

    def _run_static(self, static: StaticDecode, rows: list[DecodeRow]) -> torch.Tensor:
        size = self.block_size
        return static.run(
            token_ids=[token for _, token, _ in rows],
            positions=[p for _, _, p in rows],
            slots=[c.block_ids[p // size] * size + p % size for c, _, p in rows],
            block_tables=[c.block_ids[: p // size + 1] for c, _, p in rows],
            adapter_slots=(
                ()
                if self.lora is None
                else [self.lora.slot_of(c.request.params.lora_name) for c, _, _ in rows]
            ),
        )

    def _prepare_inputs(
        self, decodes: list[DecodeRow], prefills: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        size = self.block_size
        device = self.device
        token_ids: list[int] = []
        decode_positions: list[int] = []
        decode_slots: list[int] = []
        for chunk, token, position in decodes:
            token_ids.append(token)
            decode_positions.append(position)
            decode_slots.append(chunk.block_ids[position // size] * size + position % size)
        # Positions and slots: the decodes' as one tensor, then one per prefill chunk computed
        # with tensor ops (a chunk can be 2k tokens; no per-token Python).
        position_parts = [torch.tensor(decode_positions, dtype=torch.int64, device=device)]
        slot_parts = [torch.tensor(decode_slots, dtype=torch.int64, device=device)]
        spans: list[PrefillSpan] = []
        for chunk in prefills:
            start, end = chunk.start_position, chunk.start_position + chunk.num_tokens
            block_ids = torch.tensor(chunk.block_ids[: -(-end // size)], device=device)
            spans.append(
                PrefillSpan(
                    token_start=len(token_ids),
                    num_tokens=chunk.num_tokens,
                    start_position=start,
                    block_ids=block_ids,
                )
            )
            token_ids.extend(chunk.token_ids)  # with its proposals, if any
            chunk_positions = torch.arange(start, end, device=device)
            position_parts.append(chunk_positions)
            slot_parts.append(block_ids[chunk_positions // size] * size + chunk_positions % size)

        max_blocks = max((-(-(p + 1) // size) for _, _, p in decodes), default=0)
        tables = [_pad(c.block_ids[:max_blocks], max_blocks) for c, _, _ in decodes]
        metadata = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts),
            num_decodes=len(decodes),
            decode_block_tables=torch.tensor(tables, dtype=torch.int64, device=device).view(
                len(decodes), max_blocks
            ),
            decode_seq_lens=torch.tensor(
                [p + 1 for _, _, p in decodes], dtype=torch.int64, device=device
            ),
            prefills=spans,
        )
        return (
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.cat(position_parts),
            metadata,
        )


def kv_cache_allocation_error(
    exc: BaseException, *, num_bytes: int, num_blocks: int, device: torch.device
) -> EngineConfigError:
    """The refusal of a KV cache the allocator could not give, in one line: the bytes asked,
    torch's reason, and the settings that size the cache on ``device``."""
    settings = "kv_cache_memory"
    if device.type == "cuda":  # where gpu_memory_utilization sizes the cache when that is unset
        settings += " or gpu_memory_utilization"
    return EngineConfigError(
        f"kv_cache_memory: cannot allocate a KV cache of {num_bytes} bytes ({num_blocks} "
        f"blocks) on {device} ({_first_line(exc)}); lower {settings}"
    )


def _is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``torch.empty`` failed for want of memory (CUDA's ``OutOfMemoryError``, the CPU
    allocator's RuntimeError "can't allocate memory: you tried to allocate N bytes"), not for
    a fault that must keep its traceback (a CUDA error left by an earlier kernel)."""
    return isinstance(exc, torch.OutOfMemoryError | MemoryError) or "allocate" in str(exc)


def check_moe_settings(
    model_config: ModelConfig, config: EngineConfig, *, fp8_linears: bool
) -> None:
    """What a mixture-of-experts model (``SparseMoe``) does not run with, refused naming the
    setting: LoRA (adapters of its experts are not built), fp8 projections (its experts stay in
    the compute dtype) and CUDA graphs (its step counts each expert's tokens on the host)."""
    arch = model_config.architecture
    if config.lora is not None:
        raise EngineConfigError(f"enable_lora: LoRA on a mixture of experts ({arch}) is not built")
    if fp8_linears:
        raise EngineConfigError(
            f"quantization: fp8 projections of a mixture of experts ({arch}) are not built"
        )
    if config.cuda_graphs:
        raise EngineConfigError(
            f"cuda_graphs: a mixture of experts ({arch}) runs eagerly (its step picks its "
            "experts on the host)"
        )


def _first_line(exc: BaseException) -> str:
    """``exc``'s message as one line, without the C++ check that torch's CPU allocator opens
    it with (``[enforce fail at alloc_cpu.cpp:127] err == 0.``)."""
    lines = str(exc).strip().splitlines()
    line = lines[0] if lines else type(exc).__name__
    return re.sub(r"^\[enforce fail at [^\]]*\][^.]*\.\s*", "", line)


DecodeRow = tuple[ScheduledChunk, int, int]
"""(chunk, token id, position): one row of a step's decodes."""


def decode_rows(chunks: list[ScheduledChunk]) -> list[DecodeRow]:
    """The decode rows of ``chunks``, in order: one per token (a plain decode has one; a chunk
    with proposals its last token's and each proposal's)."""
    rows: list[DecodeRow] = []
    for chunk in chunks:
        start = chunk.start_position
        if not chunk.draft_token_ids:
            rows.append((chunk, chunk.request.token_ids[start], start))
            continue
        rows.extend((chunk, token, start + i) for i, token in enumerate(chunk.token_ids))
    return rows


def _lora_row_slots(
    lora: LoraState,
    decodes: list[DecodeRow],
    prefills: list[ScheduledChunk],
    spans: list[PrefillSpan],
    device: torch.device,
) -> torch.Tensor | None:
    """Each row's adapter slot (-1: none), int64 ``[num_tokens]`` on ``device``, over the step's
    flat tokens (the decode rows first, then each prefill span's); None where no row runs with
    an adapter (the deltas are skipped)."""
    names = [chunk.request.params.lora_name for chunk in (*(c for c, _, _ in decodes), *prefills)]
    if not any(names):
        return None
    slots = [lora.slot_of(name) for name in names[: len(decodes)]]
    for span, name in zip(spans, names[len(decodes) :], strict=True):
        slots += [lora.slot_of(name)] * span.num_tokens
    return torch.tensor(slots, dtype=torch.int64, device=device)


def _pad(block_ids: list[int], length: int) -> list[int]:
    # Padding points at block 0, a real block; the attention mask hides it.
    return block_ids + [0] * (length - len(block_ids))
