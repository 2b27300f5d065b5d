"""LoRA adapters in the offline ``LLM`` (vLLM's ``enable_lora`` and ``lora_request``).

The reference is a Hugging Face forward pass (fp32) over the base weights with each adapter
merged in (``W + s B A``, PEFT's arithmetic): one call mixing two adapters and the base model
must give each prompt its own model's prompt logprobs and greedy tokens, whole or with prompts
cut into chunks that share steps with other requests' decodes. Prefix-cache blocks stay within
an adapter; adapters the engine cannot apply are refused naming what is wrong.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine import LLM, BeamSearchParams, LoRARequest, SamplingParams
from services.models.lora import LoraAdapterError
from services.types import SamplingParamError
from support.lora_adapter import Deltas, write_adapter


def merged_model(model_dir: Path, deltas: Deltas | None, scale: float) -> torch.nn.Module:
    """The HF model (fp32) with ``W += scale * B @ A`` for each adapted projection."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    with torch.no_grad():
        for (layer, name), (a, b) in (deltas or {}).items():
            block = model.model.layers[layer]
            module = getattr(block.self_attn if hasattr(block.self_attn, name) else block.mlp, name)
            module.weight += scale * b @ a
    return model


def reference(
    model: torch.nn.Module, prompt: list[int], steps: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens, and the prompt's logprobs ``[len, vocab]`` (row p predicts token p + 1),
    computed on the model's device."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        prompt_rows = model(torch.tensor([prompt], device=device)).logits[0].log_softmax(-1)
        tokens = list(prompt)
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens], device=device)).logits[0, -1].argmax()))
    return tokens[len(prompt) :], prompt_rows.cpu()


STEPS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two adapters: every projection (rank 4, alpha 8), and q and v only with rsLoRA (rank 8,
    alpha 4); each with its HF reference model."""
    root = tmp_path_factory.mktemp("adapters")
    every = write_adapter(root / "every", tiny_llama_dir, seed=1)
    qv = write_adapter(
        root / "qv",
        tiny_llama_dir,
        targets=("q_proj", "v_proj"),
        rank=8,
        alpha=4.0,
        seed=2,
        extra_config={"use_rslora": True},
    )
    return {
        "every": (
            LoRARequest("every", 1, root / "every"),
            merged_model(tiny_llama_dir, every, 2.0),
        ),
        "qv": (
            LoRARequest("qv", 2, str(root / "qv")),
            merged_model(tiny_llama_dir, qv, 4.0 / math.sqrt(8)),
        ),
        None: (None, merged_model(tiny_llama_dir, None, 0.0)),
    }


def lora_llm(model_dir: Path, **kwargs) -> LLM:
    options = {"dtype": "float32", "kv_cache_dtype": "float32", "max_loras": 2, **kwargs}
    return LLM(model_dir, max_model_len=128, enable_lora=True, **options)


@pytest.mark.parametrize(
    ("budget", "device", "cuda_graphs"),
    [
        (2048, "cpu", None),
        (16, "cpu", None),  # 16: prompts in chunks beside others' decodes
        # Decode-only steps on the static inputs a CUDA graph replays (run eagerly on a CPU):
        # each row's adapter slot is one of them.
        (2048, "cpu", True),
        # Graphs captured at start-up, before any adapter was loaded, replay every adapter.
        pytest.param(2048, "cuda", None, marks=pytest.mark.gpu),
    ],
)
def test_each_prompt_runs_its_own_adapter(
    tiny_llama_dir: Path, adapters, budget: int, device: str, cuda_graphs: bool | None
) -> None:
    rng = random.Random(4)
    names = ["every", "qv", None, "every", None, "qv"]
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in (20, 35, 11, 3, 40, 17)]
    llm = lora_llm(
        tiny_llama_dir,
        max_num_batched_tokens=budget,
        device=device,
        cuda_graphs=cuda_graphs,
        kv_cache_memory=64 << 20,  # not a GPU's default share of its memory
    )
    static = llm.engine.runner.static_decode
    assert (static is not None) == (cuda_graphs or device == "cuda")
    static_steps: list[int] = []
    if static is not None:  # counts the decode steps that take the static path
        run = static.run
        static.run = lambda *a, **k: static_steps.append(1) or run(*a, **k)  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(
        prompts, params, lora_request=[adapters[name][0] for name in names], use_tqdm=False
    )
    if static is not None:
        assert static.use_graphs == (device == "cuda") and static.lora is llm.engine.runner.lora
        assert static_steps, "no decode step took the static path"
    # The reference on the engine's device (a GPU's fp32 differs from a CPU's in the last bits).
    models = {name: copy.deepcopy(model).to(device) for name, (_, model) in adapters.items()}
    base_tokens = {}
    for name, prompt, output in zip(names, prompts, outputs, strict=True):
        tokens, rows = reference(models[name], prompt, STEPS)
        assert output.token_ids == tokens, name
        assert output.prompt_logprobs is not None
        for position in range(1, len(prompt)):
            entry = output.prompt_logprobs[position]
            assert entry is not None
            token = prompt[position]
            assert entry[token].logprob == pytest.approx(rows[position - 1, token].item(), abs=1e-4)
        if name is None:
            continue
        base_tokens[name], _ = reference(models[None], prompt, STEPS)
        assert output.token_ids != base_tokens[name], f"{name} changed nothing"
    # Decode steps without an adapter row (a graph without the deltas, where graphs are), then
    # with one again: each as its model.
    greedy = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    for name in (None, "every"):
        (again,) = llm.generate([prompts[2]], greedy, lora_request=adapters[name][0])
        assert again.token_ids == reference(models[name], prompts[2], STEPS)[0], name
    assert llm.engine.stats().num_blocks_used == 0


def test_an_adapters_prefix_cache_blocks_are_its_own(tiny_llama_dir: Path, adapters) -> None:
    llm = lora_llm(tiny_llama_dir)
    prompt = list(range(100, 140))  # two full blocks of 16
    every = adapters["every"][0]

    def cached(lora_request: LoRARequest | None) -> int:
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=1), lora_request=lora_request)
        return out.num_cached_tokens

    assert [cached(None), cached(every), cached(every), cached(None)] == [0, 0, 32, 32]
    qv = adapters["qv"][0]
    assert cached(qv) == 0


def test_max_loras_unloads_the_least_recently_used(tiny_llama_dir: Path, adapters) -> None:
    llm = lora_llm(tiny_llama_dir, max_loras=1)
    every, qv = adapters["every"][0], adapters["qv"][0]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    (first,) = llm.generate([[5, 6, 7]], params, lora_request=every)
    (other,) = llm.generate([[5, 6, 7]], params, lora_request=qv)
    assert llm.engine.lora_names == {"qv"}
    # qv took every's slot, whose k, o and MLP columns it does not adapt: zeroed, not left.
    assert other.token_ids == reference(adapters["qv"][1], [5, 6, 7], 2)[0]
    (again,) = llm.generate([[5, 6, 7]], params, lora_request=every)
    assert again.token_ids == first.token_ids and llm.engine.lora_names == {"every"}
    with pytest.raises(ValueError, match="max_loras is 1"):
        llm.generate([[5], [6]], params, lora_request=[every, qv])
    assert llm.engine.stats().num_blocks_used == 0


def test_lora_requests_are_checked(tiny_llama_dir: Path, adapters, tmp_path: Path) -> None:
    every = adapters["every"][0]
    params = SamplingParams(max_tokens=1)
    plain = LLM(tiny_llama_dir, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([[5]], params, lora_request=every)
    with pytest.raises(SamplingParamError, match="LoRA is off") as off:
        plain.generate([[5]], SamplingParams(lora_name="every"))
    assert off.value.param == "lora_name"
    llm = lora_llm(tiny_llama_dir)
    with pytest.raises(SamplingParamError, match="no LoRA adapter 'nope' is loaded"):
        llm.generate([[5]], SamplingParams(lora_name="nope"))
    with pytest.raises(ValueError, match="2 lora_requests for 1 prompts"):
        llm.generate([[5]], params, lora_request=[every, every])
    moved = LoRARequest("every", 1, tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="from two paths"):
        llm.generate([[5], [6]], params, lora_request=[every, moved])
    llm.generate([[5]], params, lora_request=every)
    with pytest.raises(ValueError, match="is loaded from"):
        llm.generate([[5]], params, lora_request=moved)
    with pytest.raises(SamplingParamError, match="differ"):
        llm.generate([[5]], SamplingParams(lora_name="qv"), lora_request=every)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, tmp_path)
    # A node of it running: not unloaded under it.
    llm.engine.add_request("running", [5, 6], SamplingParams(max_tokens=4, lora_name="every"))
    with pytest.raises(ValueError, match="in use by request 'running'"):
        llm.engine.remove_lora("every")
    llm.engine.abort("running")
    assert llm.engine.remove_lora("every") and not llm.engine.remove_lora("every")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"missing": True}, "no adapter_config.json"),
        ({"rank": 32}, "rank 32 is above max_lora_rank 16"),
        ({"extra_config": {"use_dora": True}}, "use_dora"),
        ({"extra_config": {"bias": "all"}}, "bias 'all'"),
        ({"extra_config": {"peft_type": "IA3"}}, "peft_type 'IA3'"),
        ({"extra_tensors": {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}},
         "lm_head.lora_A.weight: only the LoRA A/B weights"),
        ({"other_model": True}, "do not fit"),
    ],
)  # fmt: skip
def test_adapters_it_cannot_apply_are_refused_naming_why(
    tiny_llama_dir: Path, tmp_path: Path, change: dict, message: str
) -> None:
    directory = tmp_path / "adapter"
    if change.get("other_model"):  # a model twice as wide
        config = json.loads((tiny_llama_dir / "config.json").read_text())
        wide = tmp_path / "wide"
        wide.mkdir()
        (wide / "config.json").write_text(
            json.dumps({**config, "hidden_size": 2 * config["hidden_size"]})
        )
        write_adapter(directory, wide)
    elif not change.get("missing"):
        options = {k: v for k, v in change.items() if k not in ("missing", "other_model")}
        write_adapter(directory, tiny_llama_dir, **options)
    llm = lora_llm(tiny_llama_dir)
    with pytest.raises(LoraAdapterError, match=message):
        llm.generate(
            [[5]], SamplingParams(max_tokens=1), lora_request=LoRARequest("a", 1, directory)
        )
    assert llm.engine.lora_names == set()


def test_beam_search_and_chat_take_an_adapter(tiny_llama_dir: Path, adapters) -> None:
    llm = lora_llm(tiny_llama_dir)
    every, qv = adapters["every"][0], adapters["qv"][0]
    prompt = [7, 8, 9, 10]
    beams = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    (with_every,) = llm.beam_search([prompt], beams, lora_request=every)
    (with_qv,) = llm.beam_search([prompt], beams, lora_request=qv)
    assert [s.tokens for s in with_every.sequences] != [s.tokens for s in with_qv.sequences]
    messages = [{"role": "user", "content": "Hi"}]
    chat = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (every_out,) = llm.chat(
        messages, chat, lora_request=every, chat_template="{{ messages[0].content }}"
    )
    (direct,) = llm.generate([every_out.prompt_token_ids], chat, lora_request=every, use_tqdm=False)
    assert every_out.token_ids == direct.token_ids


def test_bfloat16_runs_the_adapter_too(tiny_llama_dir: Path, adapters) -> None:
    # bf16 on this host may run the packed kernels or plain linears: either way the adapter's
    # deltas reach the output, and the base rows of the same call are the base model's up to
    # bf16 rounding. Not bit for bit: with an adapter in the batch the MLP computes gate and up
    # apart, to add their deltas before SiLU, and rounds each to bf16, where the base model's
    # few-row kernel (AVX512-BF16) applies SiLU-and-mul to the fp32 sums; greedy tokens of the
    # random tiny model then part after a few steps on such a host.
    llm = lora_llm(tiny_llama_dir, dtype="bfloat16", kv_cache_dtype="bfloat16")
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    with_every, base = llm.generate(
        [prompt, prompt], params, lora_request=[adapters["every"][0], None], use_tqdm=False
    )
    (alone,) = llm.generate([prompt], params, use_tqdm=False)

    def logprob_gaps(output) -> list[float]:
        """|this output's prompt logprob - the base model's alone| at each prompt token."""
        assert output.prompt_logprobs is not None and alone.prompt_logprobs is not None
        return [
            abs(output.prompt_logprobs[p][t].logprob - alone.prompt_logprobs[p][t].logprob)
            for p, t in enumerate(prompt)
            if p > 0
        ]

    # A bf16 logit of the tiny model's size (4-8) moves by 0.03-0.06 an ulp.
    assert max(logprob_gaps(base)) < 0.25
    assert max(logprob_gaps(with_every)) > 1.0
    assert with_every.token_ids != base.token_ids


def test_a_retired_adapter_serves_its_running_requests_then_unloads(
    tiny_llama_dir: Path, adapters
) -> None:
    """A node's run-time unload: new requests may not name the adapter at once; the one running
    finishes with the adapter's own tokens, and the adapter is dropped when it ends. The same
    files loaded again meanwhile keep it; other files under its name are refused."""
    every, model = adapters["every"]
    engine = lora_llm(tiny_llama_dir, max_loras=2).engine
    assert engine.add_lora(every) is True
    assert engine.add_lora(every) is False  # the same files again: nothing to do
    prompt = [5, 9, 33, 71, 200, 7]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, lora_name="every")
    engine.add_request("r", prompt, params)
    engine.step()  # the prompt, and the first token
    stats = engine.stats()
    assert (stats.lora_running, stats.lora_waiting, stats.max_loras) == (("every",), (), 2)
    assert engine.retire_lora("every") == 1
    assert "every" not in engine.lora_names and "every" not in engine.stats().lora_names
    with pytest.raises(SamplingParamError, match="'every' is being unloaded") as refused:
        engine.add_request("late", prompt, params)
    assert refused.value.param == "lora_name"
    assert engine.retire_lora("every") is None  # already on its way out
    tokens: list[int] = []
    while engine.has_unfinished_requests:
        for output in engine.step():
            tokens.extend(output.new_token_ids)
    expected, _ = reference(model, prompt, STEPS)
    assert tokens == expected[1:]  # every token after the retire is still the adapter's
    assert engine.runner.lora is not None and "every" not in engine.runner.lora.adapters

    # Loaded again while a request still runs with it: retiring is called off.
    engine.add_lora(every)
    engine.add_request("r2", prompt, params)
    engine.step()
    assert engine.retire_lora("every") == 1
    other = LoRARequest("every", 1, adapters["qv"][0].lora_path)
    with pytest.raises(ValueError, match="being unloaded"):
        engine.add_lora(other)
    assert engine.add_lora(every) is True and "every" in engine.lora_names  # kept again
    while engine.has_unfinished_requests:
        engine.step()
    assert "every" in engine.runner.lora.adapters  # kept: loaded again before its request ended
    assert engine.retire_lora("every") == 0  # nothing runs with it: dropped at once
    assert "every" not in engine.runner.lora.adapters
    assert engine.retire_lora("missing") is None


def test_an_aborted_last_request_unloads_a_retired_adapter(tiny_llama_dir: Path, adapters) -> None:
    every, _ = adapters["every"]
    engine = lora_llm(tiny_llama_dir).engine
    engine.add_lora(every)
    params = SamplingParams(max_tokens=50, ignore_eos=True, lora_name="every")
    engine.add_request("r", [5, 9, 33], params)
    assert engine.retire_lora("every") == 1  # queued, not yet stepped
    assert "every" in engine.runner.lora.adapters
    engine.abort("r")
    assert "every" not in engine.runner.lora.adapters


def test_an_embedding_runs_its_adapter(tiny_llama_dir: Path, adapters) -> None:
    """``LLM.embed(..., lora_request=...)``: the last token's final hidden state of the model
    with the adapter merged, and of the base model beside it."""
    llm = lora_llm(tiny_llama_dir)
    prompt = [5, 9, 33, 71, 200, 7, 19]
    every, merged = adapters["every"]
    for lora, model in ((every, merged), (None, adapters[None][1])):
        (out,) = llm.embed([prompt], lora_request=lora, use_tqdm=False)
        with torch.inference_mode():
            hidden = model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(hidden, dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5,
                                   rtol=1e-4)  # fmt: skip


def test_a_prefill_node_keeps_an_unloaded_adapter_for_its_grace(
    tiny_llama_dir: Path, adapters
) -> None:
    """A disaggregated request reserved on its decode node before an unload reaches its
    prefill node after it: for the grace, such ``hold_kv`` requests may still name the
    adapter; other requests may not, and the load report no longer lists it."""
    every, _ = adapters["every"]
    engine = lora_llm(tiny_llama_dir).engine
    engine.add_lora(every)
    assert engine.retire_lora("every", grace_s=0.2) == 0  # nothing runs with it, yet kept
    assert "every" not in engine.stats().lora_names
    params = SamplingParams(max_tokens=1, lora_name="every")
    engine.add_request("prefill", [5, 9, 33], params, hold_kv=True)
    with pytest.raises(SamplingParamError, match="being unloaded"):
        engine.add_request("new", [5, 9, 33], params)
    while engine.has_unfinished_requests:
        engine.step()
    engine.release_kv("prefill")
    time.sleep(0.3)  # past the grace
    engine.abort("nothing")  # an abort (or a step) drops what is due
    assert "every" not in engine.runner.lora.adapters


@pytest.mark.parametrize("cuda_graphs", [None, True])
def test_speculative_rows_run_their_requests_adapter(
    tiny_llama_dir: Path, adapters, cuda_graphs: bool | None
) -> None:
    """A request's proposals are decode rows of its adapter (on the dynamic path, and on the
    static inputs CUDA graphs replay, run eagerly here): the tokens of the run without them."""
    names = ["every", "qv", None, "every"]
    prompts = [[3, 4] * 12, [9, 10, 11] * 8, [3, 4] * 12, [500, 600, 700, 800] * 5]
    requests = [adapters[name][0] for name in names]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spec = {"num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    expected = lora_llm(tiny_llama_dir, kv_cache_memory=16 << 20).generate(
        prompts, params, lora_request=requests, use_tqdm=False
    )
    llm = lora_llm(
        tiny_llama_dir, kv_cache_memory=16 << 20, cuda_graphs=cuda_graphs, speculative_config=spec
    )
    got = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert llm.engine.stats().num_accepted_tokens_total > 0
