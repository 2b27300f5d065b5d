"""Embedding throughput: the offline engine's ``LLM.embed`` against transformers, both taking the
final hidden state of each prompt's last token and L2-normalizing it (last-token pooling).

    python benchmarks/embedding_throughput.py [--model DIR] [--num-prompts 256]
        [--min-len 32] [--max-len 512] [--dtype auto] [--hf-dtype default] [--batch-size 32]
        [--rounds 2]

The prompts are random token ids of lengths drawn between ``--min-len`` and ``--max-len``.
transformers runs ``AutoModel`` over batches of ``--batch-size`` prompts sorted by length (as
sentence-transformers batches them, so padding is least), right-padded with an attention mask;
``--hf-dtype default`` is its own default (float32). The two runs take turns ``--rounds`` times,
each keeping its best; the vectors are compared (the lowest cosine similarity is printed) so the
two compute the same thing. Prints prompt tok/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import LLM  # noqa: E402
from services.host_memory import restart_with_huge_page_heap  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "small-llama"


def transformers_embed(
    model: torch.nn.Module, prompts: list[list[int]], batch_size: int
) -> list[torch.Tensor]:
    """Each prompt's normalized last-token hidden state ``[hidden_size]``, in prompt order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[row, : len(prompts[i])] = 1
            # hidden: [batch, width, hidden_size]; each row's last real token is at len - 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = mask.sum(dim=1) - 1
            pooled = torch.nn.functional.normalize(
                hidden[torch.arange(len(batch)), last].float(), dim=-1
            )
            for row, i in enumerate(batch):
                out[i] = pooled[row]
    return [vector for vector in out if vector is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--hf-dtype", default="default")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoModel

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_len, enable_prefix_caching=False)
    hf_dtype = None if args.hf_dtype == "default" else getattr(torch, args.hf_dtype)
    hf = AutoModel.from_pretrained(args.model, dtype=hf_dtype, local_files_only=True).eval()
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        [rng.randrange(16, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.num_prompts)
    ]
    llm.embed(prompts[:2], use_tqdm=False)  # warm-up: kernels
    transformers_embed(hf, prompts[:2], args.batch_size)
    best = {"pdserve": float("inf"), "transformers": float("inf")}
    ours: list[list[float]] = []
    theirs: list[torch.Tensor] = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        ours = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
        best["pdserve"] = min(best["pdserve"], time.perf_counter() - start)
        start = time.perf_counter()
        theirs = transformers_embed(hf, prompts, args.batch_size)
        best["transformers"] = min(best["transformers"], time.perf_counter() - start)
    cosine = min(float(torch.dot(torch.tensor(a), b)) for a, b in zip(ours, theirs, strict=True))
    tokens = sum(map(len, prompts))
    print(f"{args.model.name}, pdserve {llm.engine.dtype_choice.dtype}, transformers "
          f"{next(hf.parameters()).dtype}, {args.num_prompts} prompts of {args.min_len}-"
          f"{args.max_len} tokens ({tokens} in all), best of {args.rounds}")  # fmt: skip
    for name, seconds in best.items():
        print(f"{name:13s} {seconds:7.2f} s  {tokens / seconds:9.1f} prompt tok/s  "
              f"{best['transformers'] / seconds:5.2f}x")  # fmt: skip
    print(f"lowest cosine similarity between the two: {cosine:.5f}")


if __name__ == "__main__":
    restart_with_huge_page_heap()
    main()
