"""llguidance against xgrammar on one JSON schema: the measurement behind the choice of engine.

    python -m pip install --no-deps --target /tmp/xgr xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
    PYTHONPATH=/tmp/xgr python benchmarks/grammar_engines.py ['{"name":"bob']

xgrammar is not a pdserve dependency (it needs torch and pulls triton), so it is installed
beside the venv for this run only. On the ``small`` model's 32,000-token vocabulary, 64
matchers are advanced over the same document prefix (argv[1], default empty); printed in ms:
building the engine's tokenizer, compiling one request's matcher (median of 5), and filling
the 64 rows' bitmask (median of 10), one matcher at a time and with the engine's batch call.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llguidance  # noqa: E402
import llguidance.torch as llg_torch  # noqa: E402
import torch  # noqa: E402
import xgrammar as xgr  # noqa: E402

from services.models.tiny import SIZES, _synthetic_corpus, build_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
BATCH = 64


def ms(fn: Callable[[], object], repeats: int = 1) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    size = SIZES["small"]
    hf = build_tokenizer(size.vocab_size, _synthetic_corpus(size), 4096)
    vocab_size = size.vocab_size
    prefix = hf.encode(sys.argv[1] if len(sys.argv) > 1 else "", add_special_tokens=False)
    results: dict[str, dict[str, float]] = {}

    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(
        hf.backend_tokenizer.to_str(), n_vocab=vocab_size, eos_token=hf.eos_token_id
    )
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )
    matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(BATCH)]
    for matcher in matchers:
        assert matcher.consume_tokens(prefix), matcher.get_error()
    bitmask = llg_torch.allocate_token_bitmask(BATCH, vocab_size)
    executor = llguidance.LLExecutor()
    pairs = [(m, i) for i, m in enumerate(matchers)]
    results["llguidance"] = {
        "tokenizer": tokenizer_ms,
        "compile": ms(lambda: llguidance.LLMatcher(tokenizer, grammar), 5),
        "fill_64": ms(
            lambda: [llg_torch.fill_next_token_bitmask(m, bitmask, i) for m, i in pairs], 10
        ),
        "fill_64_batch_call": ms(
            lambda: llg_torch.fill_next_token_bitmask_par(executor, pairs, bitmask), 10
        ),
    }

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    schema = json.dumps(SCHEMA)

    def compile_xgr() -> xgr.CompiledGrammar:
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    compiled = compile_xgr()
    xmatchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    for matcher in xmatchers:
        assert all(matcher.accept_token(t) for t in prefix)
    xbitmask = xgr.allocate_token_bitmask(BATCH, vocab_size)
    batch = xgr.BatchGrammarMatcher()
    results["xgrammar"] = {
        "tokenizer": tokenizer_ms,
        "compile": ms(lambda: xgr.GrammarMatcher(compile_xgr()), 5),
        "fill_64": ms(
            lambda: [m.fill_next_token_bitmask(xbitmask, i) for i, m in enumerate(xmatchers)], 10
        ),
        "fill_64_batch_call": ms(
            lambda: batch.batch_fill_next_token_bitmask(xmatchers, xbitmask), 10
        ),
    }
    print(json.dumps(results, indent=1))
    print("identical masks:", torch.equal(bitmask, xbitmask.to(torch.int32)))


if __name__ == "__main__":
    main()
