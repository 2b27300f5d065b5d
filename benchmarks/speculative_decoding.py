"""Speculative decoding by n-gram prompt lookup in the offline engine: output tok/s with and
without it, at several batch sizes, on a workload that copies from its prompt and on one that
does not.

    python benchmarks/speculative_decoding.py [--model models/SmolLM2-135M-Instruct]
        [--batch-sizes 1,4,16,64] [--output-len 128] [--num-speculative-tokens 4]
        [--prompt-lookup-max 4] [--prompt-lookup-min 2] [--disable-by-batch-size N]
        [--rounds 2] [--dtype auto] [--device cuda]
        [--workloads edit,chat]

Each batch size runs an engine of that ``max_num_seqs`` over at least eight prompts (at 1, one
after another). ``edit``: chat requests that ask the model to rename an identifier in a short
program and repeat it (most of the answer is in the prompt); ``chat``: open questions (little
of it is).
Both greedy, so every output of the speculating engine must equal the plain engine's: the
script counts those that do. The two engines take turns ``--rounds`` times per batch size and
each keeps its best time. Prints, per workload and batch size: output tok/s of each, the
ratio, the share of proposals kept, and the tokens each verifying step produced on average.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import LLM, SamplingParams  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"

PROGRAMS = [
    """def {name}(values):
    total = 0
    count = 0
    for value in values:
        if value is None:
            continue
        total += value
        count += 1
    if count == 0:
        return 0.0
    return total / count
""",
    """class {name}:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = []

    def push(self, item):
        if len(self.items) >= self.capacity:
            raise OverflowError("full")
        self.items.append(item)

    def pop(self):
        return self.items.pop()
""",
    """def {name}(text):
    words = text.split()
    counts = {{}}
    for word in words:
        word = word.lower().strip(".,;:!?")
        counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda pair: -pair[1])
""",
    """def {name}(a, b):
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result
""",
]
NAMES = ["process", "handle", "compute", "build", "collect", "merge", "update", "load"]
QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a rainbow forms.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle for a child.",
    "Give me three ideas for a weekend trip.",
    "Why do cats purr?",
    "How does a bicycle stay upright?",
    "What makes bread rise?",
]


def edit_messages(count: int) -> list[list[dict[str, str]]]:
    messages = []
    for i in range(count):
        name = NAMES[i % len(NAMES)]
        program = PROGRAMS[i % len(PROGRAMS)].format(name=name)
        ask = f"Rename {name} to {name}_v2 and repeat the whole code:\n\n{program}"
        messages.append([{"role": "user", "content": ask}])
    return messages


def chat_messages(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]


WORKLOADS = {"edit": edit_messages, "chat": chat_messages}
MIN_PROMPTS = 8
"""Prompts of a run at least: every program and question, whatever the batch."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workloads", default="edit,chat")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    speculative = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
    print(f"model {args.model.name}, {speculative}, greedy, {args.output_len} tokens at most")
    print("workload batch | plain tok/s | spec tok/s | ratio | kept | tokens/step | same")
    for batch in batch_sizes:
        # max_num_seqs is the batch: at 1, the prompts run one after another.
        common = {
            "dtype": args.dtype,
            "device": args.device,
            "max_num_seqs": batch,
            "max_model_len": 1024,
        }
        plain = LLM(args.model, **common)
        spec = LLM(args.model, speculative_config=speculative, **common)
        for workload in args.workloads.split(","):
            messages = WORKLOADS[workload](max(batch, MIN_PROMPTS))
            best: dict[str, float] = {}
            outputs: dict[str, list[list[int]]] = {}
            drafted = kept = 0
            for round_index in range(args.rounds):
                order = ("plain", "spec") if round_index % 2 == 0 else ("spec", "plain")
                for name in order:
                    llm = plain if name == "plain" else spec
                    before = llm.engine.stats()
                    start = time.perf_counter()
                    results = llm.chat(messages, params, use_tqdm=False)
                    seconds = time.perf_counter() - start
                    after = llm.engine.stats()
                    tokens = [r.outputs[0].token_ids for r in results]
                    rate = sum(len(t) for t in tokens) / seconds
                    best[name] = max(best.get(name, 0.0), rate)
                    outputs[name] = tokens
                    if name == "spec":
                        drafted = after.num_draft_tokens_total - before.num_draft_tokens_total
                        kept = after.num_accepted_tokens_total - before.num_accepted_tokens_total
            same = sum(a == b for a, b in zip(outputs["plain"], outputs["spec"], strict=True))
            total = sum(len(t) for t in outputs["spec"])
            # Steps that verified proposals produced kept + one each; the share of a request's
            # tokens per step, over the whole run: tokens / (tokens - kept).
            per_step = total / max(total - kept, 1)
            print(
                f"{workload:8s} {batch:5d} | {best['plain']:11.1f} | {best['spec']:10.1f} | "
                f"{best['spec'] / best['plain']:5.2f} | "
                f"{f'{kept / drafted:4.0%}' if drafted else ' n/a'} | "
                f"{per_step:11.2f} | {same}/{len(messages)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
