"""``LLM(seed=...)``: what requests without a seed of their own sample from (vLLM's engine seed).

The same seed gives the same tokens from one engine to the next, whatever the caller does with
torch's global generator; another seed gives others; ``seed=None`` a fresh seed each time. A
request's own seed gives its tokens, alone or in any batch, on the CPU and on a GPU.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.engine import LLM, SamplingParams
from support.small_llm import small_llm

PROMPTS = [[10, 11, 12, 13], [7, 300, 4000], [42]]
UNSEEDED = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_llm(
    model_dir: Path,
    seed: int | None,
    *,
    cuda_graphs: bool | None = None,
    backend: str = "auto",
    device: str = "cpu",
) -> LLM:
    return small_llm(
        model_dir, seed=seed, attention_backend=backend, cuda_graphs=cuda_graphs, device=device
    )


def sample(llm: LLM) -> list[list[int]]:
    return [output.token_ids for output in llm.generate(PROMPTS, UNSEEDED)]


def test_the_same_seed_gives_the_same_tokens_whatever_the_global_generator(
    tiny_llama_dir: Path,
) -> None:
    first = make_llm(tiny_llama_dir, seed=7)
    torch.manual_seed(1)
    expected = sample(first)
    second = make_llm(tiny_llama_dir, seed=7)
    torch.manual_seed(2)  # the caller's own use of torch's RNG changes nothing
    global_state = torch.get_rng_state()
    assert sample(second) == expected
    assert torch.equal(torch.get_rng_state(), global_state), "the engine drew from torch's RNG"
    # Later calls go on from where the generator is: new tokens, again the same in both.
    assert sample(first) == sample(second) != expected


def test_other_seeds_give_other_tokens(tiny_llama_dir: Path) -> None:
    torch.manual_seed(0)
    with_seed_7 = sample(make_llm(tiny_llama_dir, seed=7))
    torch.manual_seed(0)
    with_seed_8 = sample(make_llm(tiny_llama_dir, seed=8))
    assert with_seed_7 != with_seed_8


def test_seed_none_is_a_fresh_seed_for_each_engine(tiny_llama_dir: Path) -> None:
    torch.manual_seed(0)
    first = sample(make_llm(tiny_llama_dir, seed=None))
    torch.manual_seed(0)
    assert sample(make_llm(tiny_llama_dir, seed=None)) != first


@pytest.mark.parametrize("seed", [-(2**63), 2**64 - 1])
def test_the_bounds_of_torchs_seeds_are_engine_seeds(tiny_llama_dir: Path, seed: int) -> None:
    outputs = make_llm(tiny_llama_dir, seed=seed).generate(PROMPTS[:1], UNSEEDED)
    assert len(outputs[0].token_ids) == UNSEEDED.max_tokens


def test_the_static_decode_path_samples_from_the_same_generator(tiny_llama_dir: Path) -> None:
    # Decode-only steps on the static buffers (CUDA graphs on a GPU; eager on the CPU) sample
    # from the engine's generator too: the same tokens as the dynamic path from the same seed.
    dynamic = make_llm(tiny_llama_dir, seed=3, cuda_graphs=False, backend="torch")
    static = make_llm(tiny_llama_dir, seed=3, cuda_graphs=True, backend="torch")
    static_decode = static.engine.runner.static_decode
    assert static_decode is not None
    calls = []
    run = static_decode.run
    static_decode.run = lambda *a, **k: calls.append(1) or run(*a, **k)  # type: ignore[method-assign]
    assert sample(static) == sample(dynamic)
    assert calls, "no step took the static path"


@pytest.mark.parametrize("device", DEVICES)
def test_a_requests_own_seed_gives_its_tokens_alone_or_in_any_batch(
    tiny_llama_dir: Path, device: str
) -> None:
    # seed=None: the unseeded neighbours draw anew each call, so each batch around it differs.
    llm = make_llm(tiny_llama_dir, seed=None, device=device)
    seeded = replace(UNSEEDED, max_tokens=8, seed=5)
    neighbour = replace(UNSEEDED, max_tokens=8)
    (alone,) = llm.generate(PROMPTS[:1], seeded)
    (again,) = llm.generate(PROMPTS[:1], seeded)
    first = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [neighbour, seeded, neighbour])
    second = llm.generate([PROMPTS[0], PROMPTS[2]], [seeded, neighbour])
    assert alone.token_ids == again.token_ids == first[1].token_ids == second[0].token_ids
    (other,) = llm.generate(PROMPTS[:1], replace(seeded, seed=6))
    assert other.token_ids != alone.token_ids
