"""Grammar matchers of an engine's constrained requests (``SamplingParams.guided``).

Life cycle of one request's matcher:

1. ``compile``, then ``add`` when the request enters the engine (``add_request``, or ``reserve``
   on a decode node), so a grammar the engine cannot use is refused with a ``ValueError`` before
   the request holds anything. ``compile`` may run on any thread, and a node runs it off its
   engine thread (``AsyncEngine``): a large grammar takes seconds (a Lark grammar of 60,000
   alternatives: 5.4 s on the Intel AMX host, the GIL released throughout), which on the engine
   thread would stall every other request's steps and every commit; ``add`` without a compiled
   matcher compiles in place (the offline ``LLM``). The compile also drives the grammar over
   its first token (``probe_error``): that first mask builds the lexer, which the matcher shares
   (``x{1000}{1000}`` burns llguidance's lexer fuel for 2-4 s there, then fails), and the
   grammars llguidance gives up on at once are refused here rather than run.
2. On a decode node, ``commit`` feeds it the first token, which the prefill node sampled under
   the same grammar: the matcher's state is rebuilt from the tokens so far rather than shipped,
   so a request's constrained output is the same disaggregated, colocated or recomputed.
3. Each step, ``bitmask`` writes the tokens each constrained row may take next; the sampler
   masks the others to -inf (unconstrained rows are not touched, and a batch without a
   constrained row costs one dict lookup per row).
4. ``accept`` advances it over the sampled token: ``GrammarState.COMPLETE`` once no token but EOS
   could follow (the request stops with ``stop``); ``FAILED`` when llguidance gave up on the
   grammar (a limit it hit further along than the compile's probe looked; ``error`` says which),
   and the request ends with ``error``, never ``stop``: its text would not match the grammar.
5. ``remove`` when the request finishes or is aborted.

The llguidance tokenizer (token bytes for the whole vocabulary, ~150 ms for 32k tokens) is built
on the first constrained request from the model's ``tokenizer.json``: the file of a Hugging Face
directory, or for a GGUF checkpoint (which has none) the one ``services.gguf_tokenizer`` builds
from its metadata, the very tokenizer the gateway encodes prompts with, so that the grammar's
token ids are the model's.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import llguidance
import torch

from services.guided_decoding import PROBE_MAX_TOKENS, GuidedDecoding, probe_error
from services.model_tokenizer import tokenizer_json

logger = logging.getLogger(__name__)

GrammarMatcher = llguidance.LLMatcher
"""One request's compiled grammar and its state (``StructuredOutputs.compile``)."""


class GrammarState(enum.Enum):
    """Where a request's grammar stands after ``StructuredOutputs.accept``."""

    OPEN = "open"
    """More tokens may follow."""
    COMPLETE = "complete"
    """Nothing but EOS can follow: the request stops with ``stop``."""
    FAILED = "failed"
    """llguidance gave up on the grammar (one of its limits): the request ends with ``error``."""


class StructuredOutputs:
    """The matchers of one engine's constrained requests, by request id."""

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """``model_path``: a Hugging Face model directory, a GGUF file or a directory holding
        one (``EngineConfig.model_dir``)."""
        self._model_path = Path(model_path)
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()  # compile() runs on any thread
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._guided: dict[str, GuidedDecoding] = {}  # beside _matchers: what an error names

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    @property
    def num_words(self) -> int:
        """int32 words per row of a bitmask: one bit per token of the model's vocabulary."""
        return (self._vocab_size + 31) // 32

    def compile(self, guided: GuidedDecoding) -> GrammarMatcher:
        """A fresh matcher for ``guided``; ``ValueError`` naming the field if it cannot be built.
        Safe on any thread: it touches nothing but the (locked) llguidance tokenizer."""
        # One compile: the matcher refuses what check() would (it used to run first, and took
        # half again as long as the compile itself).
        tokenizer = self.llg_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, guided.to_grammar(), log_level=0)
        error = matcher.get_error() or probe_error(matcher, PROBE_MAX_TOKENS, tokenizer.eos_tokens)
        if error:
            raise guided.invalid(error)
        return matcher

    def add(
        self,
        request_id: str,
        guided: GuidedDecoding,
        matcher: GrammarMatcher | None = None,
    ) -> None:
        """Track ``request_id``'s matcher: ``matcher``, compiled from ``guided`` beforehand (and
        used by no one else), or compiled here."""
        assert request_id not in self._matchers, request_id
        self._matchers[request_id] = self.compile(guided) if matcher is None else matcher
        self._guided[request_id] = guided

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._guided.pop(request_id, None)

    def is_allowed(self, request_id: str, token_id: int) -> bool:
        """Whether the grammar lets ``token_id`` come next (a commit's first token)."""
        return self._matchers[request_id].validate_tokens([token_id]) == 1

    def accept(self, request_id: str, token_id: int) -> GrammarState:
        """Advance over a sampled token."""
        matcher = self._matchers[request_id]
        if not matcher.consume_token(token_id):
            # The sampler only draws allowed tokens, so llguidance gave up: a limit of its own
            # (lexer fuel, a row of more than 2,000 items), hit here or in the last mask (which
            # then allowed EOS alone).
            logger.warning("request %s: %s", request_id, self.error(request_id))
            return GrammarState.FAILED
        return GrammarState.COMPLETE if matcher.is_stopped() else GrammarState.OPEN

    def error(self, request_id: str) -> str:
        """Why ``request_id``'s grammar ``FAILED``, naming its field."""
        return self._guided[request_id].failed(self._matchers[request_id].get_error())

    def bitmask(self, request_ids: Sequence[str]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens of the constrained rows among ``request_ids`` (one per row), or
        None when no row is constrained.

        Returns ``(bitmask, rows)``: ``bitmask: [len(rows), num_words]`` int32 on the CPU, bit
        ``j`` of word ``w`` allows token ``32 * w + j``; ``rows``: their row indices."""
        if not self._matchers:
            return None
        rows = [row for row, request_id in enumerate(request_ids) if request_id in self._matchers]
        if not rows:
            return None
        bitmask = torch.empty(len(rows), self.num_words, dtype=torch.int32)
        num_bytes = self.num_words * 4
        for index, row in enumerate(rows):
            matcher = self._matchers[request_ids[row]]
            # Writes the row in place and releases the GIL while it computes.
            matcher.unsafe_compute_mask_ptr(bitmask[index].data_ptr(), num_bytes)
        return bitmask, rows

    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        """The model's tokenizer as llguidance sees it, built on first use; ``ValueError`` when
        the model has none pdserve can read."""
        with self._tokenizer_lock:
            return self._build_llg_tokenizer()

    def _build_llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                tokenizer_json(self._model_path, "guided decoding"),
                n_vocab=self._vocab_size,
                eos_token=self._eos_token_ids or None,
            )
        return self._tokenizer
