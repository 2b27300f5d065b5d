"""Offline batch generation, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast

from tokenizers import Tokenizer as HfTokenizer

from services.bad_words import bad_words_token_ids
from services.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from services.chat_template import ChatRequestError, ChatTemplate, ChatTemplateError
from services.engine.config import (
    CacheConfig,
    EngineConfig,
    LoraConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    default_max_num_batched_tokens,
)
from services.engine.engine_core import EngineCore
from services.engine.logprob import Logprob, logprob_entries
from services.engine.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from services.engine.progress import Progress, RoundProgress, UseTqdm, check_use_tqdm
from services.engine.text_stops import TextStops
from services.model_tokenizer import chat_template_parts, load_tokenizer
from services.prompt_context import prompt_context, text_after
from services.types import (
    EngineConfigError,
    FinishReason,
    PoolingParams,
    SamplingParamError,
    SamplingParams,
)
from services.types.lora_request import LoRARequest
from services.types.sampling_params import MAX_SEED

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


class TokensPrompt(TypedDict):
    """A prompt as vLLM's ``TokensPrompt``: ``{"prompt_token_ids": [...]}``, and its
    ``cache_salt`` (``SamplingParams.cache_salt``); no other keys."""

    prompt_token_ids: Sequence[int]
    cache_salt: NotRequired[str]


class TextPrompt(TypedDict):
    """A prompt as vLLM's ``TextPrompt``: ``{"prompt": "..."}``, and its ``cache_salt``; no other
    keys."""

    prompt: str
    cache_salt: NotRequired[str]


Prompt = str | Sequence[int] | TextPrompt | TokensPrompt
"""One prompt: its text, its token ids, or vLLM's ``{"prompt": ...}`` /
``{"prompt_token_ids": [...]}``."""


_TEXT_PURPOSE = "text in and out of LLM.generate"


class LLM:
    """``LLM(model).generate(prompts, sampling_params)`` over the continuous-batching engine.

    ``model`` (vLLM's name) is a Hugging Face model directory, a GGUF file, or a directory
    holding one.
    Text prompts are encoded, and outputs decoded, with the model's own tokenizer (the one the
    gateway uses); ``skip_tokenizer_init=True`` (vLLM's) loads none: prompts are token ids and
    outputs carry no text.
    """

    def __init__(
        self,
        model: str | Path,
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
        skip_tokenizer_init: bool = False,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        trust_remote_code: bool = False,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        quantization: str | None = None,
        hf_overrides: Mapping[str, Any] | None = None,
        speculative_config: Mapping[str, Any] | None = None,
    ) -> None:
        """``max_num_batched_tokens``: None picks ``default_max_num_batched_tokens`` for
        ``device`` (2,048 on a CPU, 16,384 on a GPU). ``seed``: what requests without a seed of
        their own sample from, reproducibly from run to run; None: a fresh seed each time
        (``EngineConfig.seed``). Bad arguments, a model the engine cannot run and a KV cache
        this process cannot allocate raise ``EngineConfigError`` (a ``ValueError``) naming the
        argument. vLLM's ``enforce_eager=True`` is ``cuda_graphs=False``; its
        ``tensor_parallel_size`` must be 1 (one device an engine); its ``trust_remote_code`` is
        taken either way, since no code from a model directory ever runs here. vLLM's
        ``enable_lora`` runs requests with PEFT LoRA adapters (``generate(...,
        lora_request=...)``), at most ``max_loras`` loaded at once (the least recently used one
        unloaded for another), each of rank ``max_lora_rank`` at most. vLLM's
        ``quantization="fp8"`` keeps the decoder's projections in fp8 and multiplies in fp8
        (a 16-bit checkpoint's quantized at load); an fp8 checkpoint needs no flag
        (``EngineConfig.quantization``). vLLM's ``hf_overrides`` replace values of the
        model's ``config.json`` (``EngineConfig.hf_overrides``). vLLM's ``speculative_config``
        (``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}``) turns on
        speculative decoding by n-gram prompt lookup (``EngineConfig.speculative``)."""
        for name, flag in (
            ("enforce_eager", enforce_eager),
            ("trust_remote_code", trust_remote_code),
            ("enable_lora", enable_lora),
        ):
            if not isinstance(flag, bool):
                raise EngineConfigError(f"{name} must be True or False, got {flag!r}")
        if enforce_eager:
            if cuda_graphs:
                raise EngineConfigError(
                    "enforce_eager=True turns CUDA graphs off: it contradicts cuda_graphs=True"
                )
            cuda_graphs = False
        if tensor_parallel_size != 1 or isinstance(tensor_parallel_size, bool):
            raise EngineConfigError(
                f"tensor_parallel_size must be 1 (an engine runs on one device), got "
                f"{tensor_parallel_size!r}"
            )
        policies = [str(policy) for policy in SchedulingPolicy]
        if scheduling_policy not in policies:
            raise EngineConfigError(
                f"scheduling_policy must be one of {', '.join(policies)}, got {scheduling_policy!r}"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_max_num_batched_tokens(device, offline=True)
        config = EngineConfig(
            model_dir=cast(Path, model),  # converted, or refused naming it, by EngineConfig
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            device=device,
            max_model_len=max_model_len,
            seed=seed,
            attention_backend=attention_backend,
            cuda_graphs=cuda_graphs,
            quantization=quantization,
            hf_overrides=hf_overrides,
            speculative=(
                None
                if speculative_config is None
                else SpeculativeConfig.from_mapping(speculative_config)
            ),
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
            lora=LoraConfig(max_loras=max_loras, max_lora_rank=max_lora_rank)
            if enable_lora
            else None,
        )
        if not isinstance(skip_tokenizer_init, bool):
            raise EngineConfigError(
                f"skip_tokenizer_init must be True or False, got {skip_tokenizer_init!r}"
            )
        self.engine = EngineCore(config)
        # After the engine: a path that is no model is refused as such, not for its tokenizer.
        self.tokenizer: HfTokenizer | None = None
        """The model's tokenizer; None with ``skip_tokenizer_init``."""
        if not skip_tokenizer_init:
            try:
                self.tokenizer = load_tokenizer(config.model_dir, _TEXT_PURPOSE)
            except ValueError as exc:
                raise EngineConfigError(
                    f"{exc}; LLM(skip_tokenizer_init=True) loads none and takes token ids"
                ) from None
        self._ids = itertools.count()
        self._model_path = config.model_dir
        self._chat_template: ChatTemplate | None = None  # the model's, compiled at first use
        self._hf_tokenizer: PreTrainedTokenizerFast | None = None  # get_tokenizer's, once built
        self._token_texts: dict[int, str] = {}  # _token_text's
        self._lora_use: dict[str, None] = {}  # loaded adapters, least recently used first

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Iterable[SamplingParams] | None = None,
        *,
        use_tqdm: UseTqdm = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: each conversation (OpenAI-style ``{"role", "content"}``
        messages; ``messages`` is one conversation or a list of them) rendered with the model's
        chat template (or ``chat_template``, Jinja source) as the gateway's chat API renders it,
        encoded without adding special tokens (the template writes its own BOS), and generated
        as ``generate`` does. ``tools`` and ``chat_template_kwargs`` reach the template as
        variables; ``use_tqdm`` is ``generate``'s. Each output's ``prompt`` is its rendered
        conversation. A conversation the template cannot render raises ``ChatRequestError`` (a
        ``ValueError``) naming the field, before anything is queued."""
        if self.tokenizer is None:
            raise ValueError(
                "chat renders text, which LLM(skip_tokenizer_init=True) cannot encode: give "
                "generate() token ids"
            )
        template = self._template(chat_template)
        variables = dict(chat_template_kwargs or {})
        if tools is not None:
            variables["tools"] = [dict(tool) for tool in tools]
        conversations = _conversations(messages)
        texts = []
        for index, conversation in enumerate(conversations):
            try:
                texts.append(
                    template.render(
                        [dict(message) for message in conversation],
                        add_generation_prompt,
                        continue_final_message,
                        **variables,
                    )
                )
            except ChatRequestError as exc:
                if len(conversations) == 1:
                    raise
                raise ChatRequestError(f"conversation {index}: {exc}", exc.param) from exc
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        prompts: list[Prompt] = [{"prompt_token_ids": e.ids} for e in encoded]
        outputs = self.generate(
            prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request
        )
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs

    def _template(self, source: str | None) -> ChatTemplate:
        """``source`` compiled, else the model's template (read and compiled once); each with
        the model's special tokens (``bos_token``...)."""
        if self._chat_template is None or source is not None:
            model_source, special_tokens, origin = chat_template_parts(self._model_path)
            if source is None:
                if model_source is None:
                    raise ValueError(
                        f"this model has no chat template ({origin} holds none): give "
                        "chat(chat_template=...) or generate() a prompt"
                    )
                try:
                    self._chat_template = ChatTemplate(model_source, special_tokens)
                except ChatTemplateError as exc:
                    raise ChatTemplateError(f"{origin}: {exc}") from None  # the file to fix
            else:
                return ChatTemplate(source, special_tokens)
        return self._chat_template

    def get_tokenizer(self) -> PreTrainedTokenizerFast:
        """vLLM's ``get_tokenizer()``: the model's tokenizer as transformers' fast tokenizer
        (``encode``, ``decode``, ``apply_chat_template``), over the same vocabulary as
        ``self.tokenizer`` and with the model's chat template and named special tokens. Built
        at first use."""
        if self.tokenizer is None:
            raise ValueError("LLM(skip_tokenizer_init=True) loads no tokenizer")
        if self._hf_tokenizer is None:
            from transformers import PreTrainedTokenizerFast  # ~2 s to import: only when asked

            template, special_tokens, _ = chat_template_parts(self._model_path)
            self._hf_tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
                tokenizer_object=self.tokenizer, chat_template=template, **special_tokens
            )
        return self._hf_tokenizer

    def generate(
        self,
        prompts: Iterable[Prompt] | str | TextPrompt | TokensPrompt,
        sampling_params: SamplingParams | Iterable[SamplingParams] | None = None,
        *,
        use_tqdm: UseTqdm = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts. A prompt is
        a string, a list of token ids, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}`` (one string or dict alone is one prompt); text is
        encoded with the tokenizer's special tokens (BOS), as the gateway's completions do.
        ``sampling_params`` (vLLM's name) is one ``SamplingParams`` for all, or one per
        prompt. Each output's ``text`` is its tokens decoded without special tokens after the
        prompt's last ones (``services.prompt_context``, as the gateway decodes them), less the
        stop token that ended it (as vLLM's); None with ``skip_tokenizer_init``. A request whose
        text reaches one of its ``stop`` strings ends there with ``stop`` (``stop_reason`` the
        string; the text without it unless ``include_stop_str_in_output``; ``token_ids`` up to
        the token that completed it). ``SamplingParams.n`` samples of a prompt are requests of
        their own (the prefix cache shares the prompt's blocks), seeded ``seed``, ``seed + 1``...
        where a seed is given, and come back as one output: ``outputs`` holds them all, the
        output's own fields are the first's. ``use_tqdm`` (vLLM's): a progress bar of the
        prompts done on stderr (``progress.UseTqdm``). ``priority`` (vLLM's): one per prompt,
        replacing its params' ``priority`` (lower is served first; an engine with
        ``scheduling_policy="fcfs"`` refuses any but 0). ``lora_request`` (vLLM's): one
        ``LoRARequest`` for all prompts or one (or None) per prompt, with ``enable_lora``: its
        adapter is loaded on first use (its prefix-cache blocks are its own)."""
        use_tqdm = check_use_tqdm(use_tqdm)
        prompts_given, salts = _prompts(prompts)
        prompt_params = self._with_bad_words(
            self._with_loras(
                _with_salts(
                    _with_priorities(_params(sampling_params, len(prompts_given)), priority),
                    salts,
                ),
                lora_request,
            )
        )
        prompts_encoded = [
            _truncated(ids, params.truncate_prompt_tokens, self.engine.max_model_len)
            for ids, params in zip(self._encode(prompts_given), prompt_params, strict=True)
        ]
        # One engine request a sample: prompt i's n samples, the j-th seeded seed + j.
        samples = [(i, j) for i, params in enumerate(prompt_params) for j in range(params.n)]
        given = [prompts_given[i] for i, _ in samples]
        prompt_ids = [prompts_encoded[i] for i, _ in samples]
        params_list = [_sample_params(prompt_params[i], j) for i, j in samples]
        request_ids = [f"llm-{next(self._ids)}" for _ in samples]
        # Validate everything before queueing anything, so a bad prompt leaves no work behind.
        for request_id, prompt, request_params in zip(
            request_ids, prompt_ids, params_list, strict=True
        ):
            self.engine.validate_request(request_id, prompt, request_params)
            if request_params.stop and self.tokenizer is None:
                raise ValueError(
                    "stop strings are matched in the text, which LLM(skip_tokenizer_init=True) "
                    "does not decode: give stop_token_ids"
                )
        stops = {
            request_id: TextStops(
                self.tokenizer,
                request_params.stop,
                request_params.include_stop_str_in_output,
                request_params.skip_special_tokens,
                self._text_context(prompt, request_params.skip_special_tokens),
            )
            for request_id, prompt, request_params in zip(
                request_ids, prompt_ids, params_list, strict=True
            )
            if request_params.stop and self.tokenizer is not None
        }
        results = {
            request_id: RequestOutput(
                request_id=request_id,
                prompt_token_ids=[int(t) for t in prompt],
                token_ids=[],
                finish_reason=None,
                logprobs=None,  # made from raw_logprobs once it ends
                prompt=original if isinstance(original, str) else None,
            )
            for request_id, prompt, original, request_params in zip(
                request_ids, prompt_ids, given, params_list, strict=True
            )
        }
        # The engine's logprobs as they come: per request, ({id: logprob}, the token's rank) per
        # generated token, and the prompt's (its entries and their tokens' ranks).
        raw_logprobs: dict[str, list[tuple[dict[int, float], int | None]]] = {
            request_id: []
            for request_id, request_params in zip(request_ids, params_list, strict=True)
            if request_params.logprobs is not None
        }
        raw_prompt_logprobs: dict[str, tuple[list[dict[int, float] | None], list[int | None]]] = {}
        prompt_of = {request_id: i for (i, _), request_id in zip(samples, request_ids, strict=True)}
        progress = Progress(use_tqdm, [params.n for params in prompt_params])
        try:
            for request_id, prompt, request_params in zip(
                request_ids, prompt_ids, params_list, strict=True
            ):
                self.engine.add_request(request_id, prompt, request_params)
            pending = len(request_ids)
            while pending:
                for out in self.engine.step():
                    result = results[out.request_id]
                    new_token_ids, new_logprobs = out.new_token_ids, out.new_logprobs
                    new_ranks: list[int | None] | None = None
                    if new_logprobs is not None:
                        new_ranks = out.new_logprob_ranks or [None] * len(new_logprobs)
                    text_stops = stops.get(out.request_id)
                    if text_stops is not None:
                        for index, token_id in enumerate(new_token_ids):
                            if text_stops.feed(token_id):
                                # The tokens after the one that completed the stop are not
                                # the output's (a step may carry more than one).
                                new_token_ids = new_token_ids[: index + 1]
                                if new_logprobs is not None and new_ranks is not None:
                                    new_logprobs = new_logprobs[: index + 1]
                                    new_ranks = new_ranks[: index + 1]
                                break
                    result.token_ids.extend(new_token_ids)
                    if (
                        new_logprobs is not None
                        and new_ranks is not None
                        and out.request_id in raw_logprobs
                    ):
                        raw_logprobs[out.request_id].extend(
                            zip(new_logprobs, new_ranks, strict=True)
                        )
                    result.num_cached_tokens = out.num_cached_tokens
                    if out.prompt_logprobs is not None:
                        raw_prompt_logprobs[out.request_id] = (
                            out.prompt_logprobs,
                            out.prompt_logprob_ranks or [None] * len(out.prompt_logprobs),
                        )
                    if text_stops is not None and text_stops.matched is not None:
                        if not out.finished:
                            self.engine.abort(out.request_id)  # its blocks are free again
                        result.finish_reason = FinishReason.STOP
                        result.stop_reason = text_stops.matched
                    elif out.finished:
                        result.finish_reason = out.finish_reason
                        result.error = out.error
                    if result.finish_reason is not None:
                        pending -= 1
                        progress.request_done(
                            prompt_of[out.request_id],
                            len(result.prompt_token_ids),
                            len(result.token_ids),
                        )
        finally:
            progress.close()
            # An interrupted call (KeyboardInterrupt, an error in the model) leaves nothing queued.
            for request_id, result in results.items():
                if result.finish_reason is None:
                    self.engine.abort(request_id)
        for request_id, request_params in zip(request_ids, params_list, strict=True):
            result = results[request_id]
            self._fill_logprobs(
                result,
                request_params,
                raw_logprobs.get(request_id),
                raw_prompt_logprobs.get(request_id),
            )
            ended_by_token = self._stop_token(result, request_params)
            if ended_by_token is not None and ended_by_token in request_params.stop_token_ids:
                result.stop_reason = ended_by_token  # vLLM's: a stop token id, never EOS
            if self.tokenizer is None or not request_params.detokenize:
                continue
            text_stops = stops.get(request_id)
            if text_stops is not None and text_stops.matched is not None:
                result.text = text_stops.text
                continue
            token_ids = result.token_ids
            if ended_by_token is not None and not request_params.include_stop_str_in_output:
                token_ids = token_ids[:-1]
            skip = request_params.skip_special_tokens
            result.text = text_after(
                self._decoder(skip), self._text_context(result.prompt_token_ids, skip), token_ids
            )
        outputs: list[RequestOutput] = []
        for (i, j), request_id in zip(samples, request_ids, strict=True):
            if j == 0:
                outputs.append(results[request_id])
            else:
                outputs[i].more_outputs.append(results[request_id].completion(j))
        return outputs

    def embed(
        self,
        prompts: Iterable[Prompt] | str | TextPrompt | TokensPrompt,
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: one embedding per prompt (prompts as ``generate`` takes them),
        the final hidden state of its last token (``PoolingParams``: normalized unless the
        model's sentence-transformers modules leave it raw,
        ``dimensions`` for a Matryoshka prefix); ``truncate_prompt_tokens`` keeps each prompt's
        last k tokens (-1: ``max_model_len``); ``lora_request`` as ``generate``'s."""
        use_tqdm = check_use_tqdm(use_tqdm)
        pooling = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(pooling, PoolingParams):
            raise ValueError(f"pooling_params must be PoolingParams, got {pooling!r}")
        prompts_given, salts = _prompts(prompts)
        params_list = self._with_loras(
            _with_salts(
                [SamplingParams(max_tokens=1, truncate_prompt_tokens=truncate_prompt_tokens)]
                * len(prompts_given),
                salts,
            ),
            lora_request,
        )
        prompt_ids = [
            list(_truncated(ids, truncate_prompt_tokens, self.engine.max_model_len))
            for ids in self._encode(prompts_given)
        ]
        request_ids = [f"llm-{next(self._ids)}" for _ in prompt_ids]
        for request_id, prompt, params in zip(request_ids, prompt_ids, params_list, strict=True):
            self.engine.validate_request(request_id, prompt, params)
        embeddings: dict[str, list[float]] = {}
        progress = Progress(use_tqdm, [1] * len(prompt_ids))
        try:
            for request_id, prompt, params in zip(
                request_ids, prompt_ids, params_list, strict=True
            ):
                self.engine.add_request(request_id, prompt, params, pooling=pooling)
            index = {request_id: i for i, request_id in enumerate(request_ids)}
            while len(embeddings) < len(request_ids):
                for out in self.engine.step():
                    if out.request_id not in index:
                        continue  # a request of the caller's own, added to the engine directly
                    assert out.embedding is not None, "an embedding request ends with it"
                    embeddings[out.request_id] = out.embedding
                    i = index[out.request_id]
                    progress.request_done(i, len(prompt_ids[i]), 0)
        finally:
            progress.close()
            for request_id in request_ids:
                if request_id not in embeddings:
                    self.engine.abort(request_id)
        return [
            EmbeddingRequestOutput(request_id, prompt, EmbeddingOutput(embeddings[request_id]))
            for request_id, prompt in zip(request_ids, prompt_ids, strict=True)
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score`` with an embedding model: the cosine similarity of each
        (``data_1``, ``data_2``) pair's embeddings; one ``data_1`` is paired with every
        ``data_2``, else the two lists pair up in order. Each distinct text is embedded once."""
        firsts = [data_1] if isinstance(data_1, str) else list(data_1)
        seconds = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if not seconds or len(firsts) != len(seconds):
            raise ValueError(
                f"data_1 has {len(firsts)} texts and data_2 {len(seconds)}: give one data_1, "
                "or as many as data_2 (at least one)"
            )
        texts = list(dict.fromkeys([*firsts, *seconds]))
        # Normalized whatever the model's default: the dot products below are cosines.
        outputs = self.embed(texts, PoolingParams(normalize=True),
                             truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                             lora_request=lora_request)  # fmt: skip
        vectors = {text: out.outputs.embedding for text, out in zip(texts, outputs, strict=True)}
        return [
            ScoringRequestOutput(
                ScoringOutput(sum(x * y for x, y in zip(vectors[a], vectors[b], strict=True)))
            )
            for a, b in zip(firsts, seconds, strict=True)
        ]

    def beam_search(
        self,
        prompts: Iterable[Prompt] | str | TextPrompt | TokensPrompt,
        params: BeamSearchParams,
        *,
        use_tqdm: UseTqdm = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: for each prompt (as ``generate`` takes them), its best
        ``params.beam_width`` sequences, best first (``services.beam_search``). Each
        generated token costs one ``generate`` round of every live beam of every prompt, one
        token each. ``use_tqdm`` (off by default, as vLLM's): a bar of the rounds run, out of
        ``max_tokens``. ``lora_request``: one adapter for every beam, as ``generate``'s."""
        use_tqdm = check_use_tqdm(use_tqdm)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"beam_search's lora_request must be one LoRARequest, got {lora_request!r}"
            )
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        given, salts = _prompts(prompts)
        if any(salt is not None for salt in salts):
            raise ValueError("beam_search takes no cache_salt: give prompts without one")
        prompt_ids = self._encode(given)
        rounds = RoundProgress(use_tqdm, params.max_tokens)

        def next_logprobs(
            token_ids: list[list[int]], round_params: SamplingParams
        ) -> list[dict[int, Logprob]]:
            outputs = self.generate(
                token_ids, round_params, use_tqdm=False, lora_request=lora_request
            )
            rounds.round_done()
            # Every request samples its one token; one ending without would drop its beam.
            return [out.logprobs[0] if out.logprobs else {} for out in outputs]

        tokenizer = self.tokenizer
        try:
            return beam_search(
                prompt_ids,
                params,
                next_logprobs,
                eos_token_ids=self.engine.model_config.eos_token_ids,
                vocab_size=self.engine.model_config.vocab_size,
                max_model_len=self.engine.max_model_len,
                decode=None
                if tokenizer is None
                else lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            )
        finally:
            rounds.close()

    def _with_loras(
        self,
        params: list[SamplingParams],
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[SamplingParams]:
        """``params`` with each prompt's adapter as ``lora_name``, its adapter loaded: those
        this call needs stay, the least recently used others are unloaded for room."""
        if lora_request is None:
            return params
        requests: list[LoRARequest | None]
        if isinstance(lora_request, LoRARequest):
            requests = [lora_request] * len(params)
        elif isinstance(lora_request, Sequence) and not isinstance(lora_request, str | bytes):
            requests = list(lora_request)
            if len(requests) != len(params):
                raise ValueError(f"got {len(requests)} lora_requests for {len(params)} prompts")
        else:
            raise ValueError(
                "lora_request must be a LoRARequest or a list of them (None for the base "
                f"model), got {type(lora_request).__name__}"
            )
        needed: dict[str, LoRARequest] = {}
        for index, item in enumerate(requests):
            if item is None:
                continue
            if not isinstance(item, LoRARequest):
                raise ValueError(f"lora_request {index} must be a LoRARequest or None")
            other = needed.setdefault(item.lora_name, item)
            if other.path != item.path:
                raise ValueError(
                    f"lora_request {index}: adapter {item.lora_name!r} from two paths "
                    f"({other.path}, {item.path})"
                )
        for index, (params_item, item) in enumerate(zip(params, requests, strict=True)):
            own = params_item.lora_name
            if item is not None and own is not None and own != item.lora_name:
                raise SamplingParamError(
                    "lora_name",
                    f"prompt {index}: SamplingParams.lora_name {own!r} and its lora_request "
                    f"{item.lora_name!r} differ",
                )
        self._load_loras(list(needed.values()))
        return [
            params_item
            if item is None
            else dataclasses.replace(params_item, lora_name=item.lora_name)
            for params_item, item in zip(params, requests, strict=True)
        ]

    def _load_loras(self, needed: list[LoRARequest]) -> None:
        """Load each of ``needed`` not loaded yet, unloading the least recently used others
        where ``max_loras`` leaves no room."""
        lora = self.engine.config.lora
        if lora is None:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        if len(needed) > lora.max_loras:
            raise ValueError(
                f"this call runs {len(needed)} LoRA adapters, max_loras is {lora.max_loras}"
            )
        names = {item.lora_name for item in needed}
        for item in needed:
            if item.lora_name in self.engine.lora_names:
                self.engine.add_lora(item)  # refuses the name loaded from another path
            else:
                for old in list(self._lora_use):
                    if len(self.engine.lora_names) < lora.max_loras:
                        break
                    if old not in names:
                        self.engine.remove_lora(old)
                        del self._lora_use[old]
                self.engine.add_lora(item)
            self._lora_use.pop(item.lora_name, None)
            self._lora_use[item.lora_name] = None  # most recently used last

    def _fill_logprobs(
        self,
        result: RequestOutput,
        params: SamplingParams,
        generated: list[tuple[dict[int, float], int | None]] | None,
        prompt: tuple[list[dict[int, float] | None], list[int | None]] | None,
    ) -> None:
        """``result``'s ``logprobs`` and ``prompt_logprobs`` as vLLM's ``Logprob`` entries, from
        what the engine gave (``generated`` per output token, ``prompt`` per prompt token)."""
        decode = self._token_text if self.tokenizer is not None and params.detokenize else None
        if generated is not None:
            result.logprobs = [
                logprob_entries(entries, token_id, rank, params.logprobs or 0, decode)
                for (entries, rank), token_id in zip(generated, result.token_ids, strict=True)
            ]
        if prompt is not None:
            result.prompt_logprobs = [
                None
                if entries is None
                else logprob_entries(entries, token_id, rank, params.prompt_logprobs or 0, decode)
                for entries, rank, token_id in zip(*prompt, result.prompt_token_ids, strict=True)
            ]

    def _token_text(self, token_id: int) -> str:
        """A token alone decoded, special tokens as their text (``Logprob.decoded_token``, as
        vLLM's); each id decoded once per ``LLM``."""
        text = self._token_texts.get(token_id)
        if text is None:
            assert self.tokenizer is not None
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _encode(self, prompts: list[str | Sequence[int]]) -> list[Sequence[int]]:
        """Token ids for each prompt, the texts encoded in one batch (``tokenizers`` runs it on
        all cores)."""
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        if not texts:
            return cast(list[Sequence[int]], prompts)
        if self.tokenizer is None:
            raise ValueError(
                "text prompts need the model's tokenizer, which LLM(skip_tokenizer_init=True) "
                "does not load: give token ids"
            )
        encoded = iter(e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=True))
        return [next(encoded) if isinstance(prompt, str) else prompt for prompt in prompts]

    def _decoder(self, skip_special_tokens: bool) -> Callable[[list[int]], str]:
        tokenizer = self.tokenizer
        assert tokenizer is not None

        def decode(token_ids: list[int]) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

        return decode

    def _text_context(self, prompt_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
        """The prompt tokens an output's text is decoded after, as the gateway decodes it: a
        SentencePiece vocabulary's first output token keeps its word-start space."""
        return prompt_context(self._decoder(skip_special_tokens), prompt_ids)

    def _with_bad_words(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """``params`` with their ``bad_words`` tokenized into ``bad_words_token_ids`` (each
        distinct params object once)."""
        if not any(item.bad_words for item in params):
            return params
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(
                "bad_words are tokenized with the model's tokenizer, which "
                "LLM(skip_tokenizer_init=True) does not load: give bad_words_token_ids"
            )

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids

        resolved: dict[int, SamplingParams] = {}
        for item in params:
            if not item.bad_words or id(item) in resolved:
                continue
            words = bad_words_token_ids(encode, item.bad_words)
            resolved[id(item)] = dataclasses.replace(
                item,
                bad_words=(),
                bad_words_token_ids=(*item.bad_words_token_ids, *words),
            )
        return [resolved.get(id(item), item) for item in params]

    def _stop_token(self, result: RequestOutput, params: SamplingParams) -> int | None:
        """The stop token (a ``stop_token_ids`` entry, or EOS) that ended the output, or None.
        Its text is left out of the output's (as vLLM, and as the gateway's text) unless
        ``include_stop_str_in_output``."""
        token_ids = result.token_ids
        if result.finish_reason is FinishReason.STOP and token_ids and result.stop_reason is None:
            last = token_ids[-1]
            eos_ids = () if params.ignore_eos else self.engine.model_config.eos_token_ids
            if last in params.stop_token_ids or last in eos_ids:
                return last
        return None


def _conversations(messages: object) -> list[Sequence[Mapping[str, Any]]]:
    """``LLM.chat``'s ``messages`` as a list of conversations: one conversation (a list whose
    items are message dicts), or a list of them. The messages themselves are checked when
    rendered (``services.chat_template``)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(
            "messages must be a list of message dicts (one conversation) or a list of such "
            f"lists, got {type(messages).__name__}"
        )
    if not messages or isinstance(messages[0], Mapping):
        return [cast(Sequence[Mapping[str, Any]], messages)]
    conversations = []
    for index, conversation in enumerate(messages):
        if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(
            conversation, Sequence
        ):
            raise ValueError(
                f"messages[{index}] must be a conversation (a list of message dicts), got "
                f"{type(conversation).__name__}"
            )
        conversations.append(conversation)
    return conversations


def _sample_params(params: SamplingParams, sample: int) -> SamplingParams:
    """The params of sample ``sample`` of a prompt (``n`` samples): one sample, its seed
    ``seed + sample`` (wrapped into the seeds' range) so that the samples differ and each stays
    reproducible."""
    seed = params.seed
    if seed is not None and sample:
        seed += sample
        if seed > MAX_SEED:
            seed -= 2**64
    return dataclasses.replace(params, n=1, seed=seed)


def _prompts(prompts: object) -> tuple[list[str | Sequence[int]], list[str | None]]:
    """Each prompt's text or token ids (the ids are checked by the engine), and its cache salt.
    vLLM's ``TextPrompt`` and ``TokensPrompt`` dicts give their ``prompt`` or
    ``prompt_token_ids`` and perhaps a ``cache_salt`` (checked by ``SamplingParams``); a dict
    with other keys is refused, since the engine would silently drop what they ask for (images,
    ...)."""
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise ValueError(
            "prompts must be a string or a list of prompts, each a string or a list of token "
            f'ids (or {{"prompt": ...}}, {{"prompt_token_ids": [...]}}), got '
            f"{type(prompts).__name__}"
        )
    listed: list[str | Sequence[int]] = []
    salts: list[str | None] = []
    for index, prompt in enumerate(prompts):
        salt = None
        if isinstance(prompt, Mapping):
            keys = set(prompt) - {"cache_salt"}
            if keys not in ({"prompt"}, {"prompt_token_ids"}):
                raise ValueError(
                    f"prompt {index} is a dict with the keys {sorted(map(str, prompt))}: the "
                    'engine takes {"prompt": "..."} or {"prompt_token_ids": [...]}, with a '
                    '"cache_salt" or alone'
                )
            salt = prompt.get("cache_salt")
            prompt = prompt["prompt"] if keys == {"prompt"} else prompt["prompt_token_ids"]
            if keys == {"prompt"} and not isinstance(prompt, str):
                raise ValueError(f'prompt {index}: "prompt" must be a string, got {prompt!r}')
            if keys == {"prompt_token_ids"} and isinstance(prompt, str):
                raise ValueError(
                    f"prompt {index}: prompt_token_ids must be a list of token ids, got a string"
                )
        if isinstance(prompt, bytes):
            raise ValueError(f"prompt {index} is bytes: give a string or token ids")
        listed.append(prompt)
        salts.append(salt)
    return listed, salts


def _with_salts(params: list[SamplingParams], salts: list[str | None]) -> list[SamplingParams]:
    """``params`` with each prompt dict's ``cache_salt``, where it gave one (vLLM's place for
    it); one also in the prompt's params must be the same."""
    salted = []
    for index, (item, salt) in enumerate(zip(params, salts, strict=True)):
        if salt is not None:
            if item.cache_salt is not None and item.cache_salt != salt:
                raise SamplingParamError(
                    "cache_salt",
                    f"prompt {index}: its cache_salt and its SamplingParams.cache_salt differ",
                )
            item = dataclasses.replace(item, cache_salt=salt)  # checked by SamplingParams
        salted.append(item)
    return salted


def _truncated(ids: Sequence[int], keep: int | None, max_model_len: int) -> Sequence[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1:
    ``max_model_len``)."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


def _with_priorities(
    params: list[SamplingParams], priority: Sequence[int] | None
) -> list[SamplingParams]:
    """``params`` with ``priority[i]`` as prompt ``i``'s priority (vLLM's ``priority`` list)."""
    if priority is None:
        return params
    if isinstance(priority, (str, bytes, Mapping)) or not isinstance(priority, Sequence):
        raise ValueError(f"priority must be a list of ints, got {type(priority).__name__}")
    if len(priority) != len(params):
        raise ValueError(f"got {len(priority)} priorities for {len(params)} prompts")
    return [
        dataclasses.replace(item, priority=value)  # checked by SamplingParams, naming priority
        for item, value in zip(params, priority, strict=True)
    ]


def _params(params: object, num_prompts: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: ``params`` repeated, or its list (default params for
    None)."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Iterable):
        raise ValueError(
            f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}"
        )
    listed = list(params)
    for index, item in enumerate(listed):
        if not isinstance(item, SamplingParams):
            raise ValueError(
                f"sampling_params[{index}] must be SamplingParams, got {type(item).__name__}"
            )
    if len(listed) != num_prompts:
        raise ValueError(f"got {len(listed)} SamplingParams for {num_prompts} prompts")
    return listed
