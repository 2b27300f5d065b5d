"""Per-step cost of guided decoding at batch 64: bitmask fill and apply against unconstrained.

    python benchmarks/guided_decoding.py [--repeats 30] [--batch 64]

On the ``small`` model's 32,000-token byte-level BPE vocabulary (trained here, as the tiny
model builder does), ``batch`` requests of one JSON schema are each advanced to a different
point of a valid document (so no two rows share a parser state and the mask cache helps less
than in a real batch of identical requests). Timed, milliseconds per step, best and median of
``repeats``:

- ``fill``: ``StructuredOutputs.bitmask`` for every row (llguidance computes each mask);
- ``sampler``: ``Sampler`` on ``[batch, 32000]`` float32 logits, greedy and with temperature
  1, unconstrained, with every row constrained, and with 1 row in 8 constrained;
- ``accept``: advancing every matcher over one token;
- ``compile``: building one request's matcher (``StructuredOutputs.add``), paid once per
  request on each node that runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine.sampler import Sampler, SamplingMetadata  # noqa: E402
from services.engine.structured_output import StructuredOutputs  # noqa: E402
from services.guided_decoding import GuidedDecoding  # noqa: E402
from services.models.tiny import SIZES, _synthetic_corpus, build_tokenizer  # noqa: E402
from services.types import SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = (
    '{"name":"Ada Lovelace","age":36,"tags":["math","poetry","engines"],'
    '"address":{"city":"London","zip":"W1"}}'
)


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) milliseconds of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))

    size = SIZES["small"]
    hf = build_tokenizer(size.vocab_size, _synthetic_corpus(size), size.max_position_embeddings)
    vocab_size = size.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_file = Path(tmp) / "tokenizer.json"
        tokenizer_file.write_text(hf.backend_tokenizer.to_str())
        structured = StructuredOutputs(tokenizer_file, vocab_size, [hf.eos_token_id])
        guided = GuidedDecoding.json_schema(SCHEMA)
        structured.add("warm-up", guided)  # builds the tokenizer (once per engine)
        structured.remove("warm-up")
        doc_ids = hf.encode(DOCUMENT, add_special_tokens=False)
        ids = [f"r{i}" for i in range(args.batch)]
        for i, request_id in enumerate(ids):
            structured.add(request_id, guided)
            for token_id in doc_ids[: (i * (len(doc_ids) - 2)) // args.batch]:
                assert not structured.accept(request_id, token_id)

        results: dict[str, tuple[float, float]] = {}
        counter = iter(range(10**9))

        def compile_one() -> None:
            name = f"c{next(counter)}"
            structured.add(name, guided)
            structured.remove(name)

        results["compile one request's matcher"] = timed(compile_one, args.repeats)
        results[f"fill: bitmask of {args.batch} rows"] = timed(
            lambda: structured.bitmask(ids), args.repeats
        )
        bitmask, rows = structured.bitmask(ids)  # type: ignore[misc]
        eighth = [r for r in rows if r % 8 == 0]
        sampler = Sampler([hf.eos_token_id])
        logits = torch.randn(args.batch, vocab_size) * 4

        def metadata(temperature: float, constrained: list[int] | None) -> SamplingMetadata:
            return SamplingMetadata(
                params=[SamplingParams(temperature=temperature)] * args.batch,
                prompt_token_ids=[[1]] * args.batch,
                output_token_ids=[[]] * args.batch,
                generators=[None] * args.batch,
                grammar_bitmask=None if constrained is None else bitmask[constrained],
                grammar_rows=() if constrained is None else tuple(constrained),
            )

        for temperature, label in ((0.0, "greedy"), (1.0, "temperature 1")):
            for constrained, what in (
                (None, "unconstrained"),
                (rows, "all rows"),
                (eighth, "1 row in 8"),
            ):
                meta = metadata(temperature, constrained)
                results[f"sampler, {label}, {what}"] = timed(
                    lambda meta=meta: sampler(logits, meta), args.repeats
                )

        def accept_all() -> None:
            # Each matcher takes one more token of the document, then steps back (rollback), so
            # every repeat times the same states.
            for i, request_id in enumerate(ids):
                position = (i * (len(doc_ids) - 2)) // args.batch
                structured.accept(request_id, doc_ids[position])
                structured._matchers[request_id].rollback(1)

        results[f"accept: advance {args.batch} matchers by one token"] = timed(
            accept_all, args.repeats
        )

    print(f"vocab {vocab_size}, batch {args.batch}, threads {torch.get_num_threads()}")
    print("| step | best ms | median ms |\n|---|---|---|")
    for name, (best, median) in results.items():
        print(f"| {name} | {best:.2f} | {median:.2f} |")
    print(json.dumps({k: v[1] for k, v in results.items()}))


if __name__ == "__main__":
    main()
