"""Embeddings (vLLM's ``LLM.embed`` and ``PoolingParams``): the last prompt token's final hidden
state, against Hugging Face's ``last_hidden_state`` (fp32, on the same device: the CPU, and a GPU
where there is one), whole or computed in chunks beside other requests' decodes, from the prefix
cache or not; a Matryoshka prefix; refusals."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from services.engine import LLM, PoolingParams, SamplingParams
from services.models.model_file_error import ModelFileError
from services.models.pooling_config import NORMALIZE_MODULE
from services.types import EngineConfigError, SamplingParamError
from support.model_dirs import with_config


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Where the engine under test and its reference both run."""
    return request.param


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path, device: str) -> torch.nn.Module:
    return (
        AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32, local_files_only=True)
        .to(device)
        .eval()
    )


def reference(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """The prompt's last token's final hidden state ``[hidden_size]``, on the CPU."""
    with torch.inference_mode():
        tokens = torch.tensor([prompt], device=model.device)
        return model(tokens).last_hidden_state[0, -1].cpu()


@pytest.mark.parametrize("budget", [2048, 16])  # 16: prompts in chunks beside decodes
def test_embeddings_are_the_last_tokens_final_hidden_state(
    matryoshka_llama_dir: Path, hf_model, device: str, budget: int
) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in (1, 7, 40, 70)]
    # 4 MiB: 2,048 tokens, room for every prompt (the default on a GPU is most of its memory).
    # The tiny llama's weights, declaring is_matryoshka (for the shortened embedding below).
    llm = LLM(matryoshka_llama_dir, dtype="float32", kv_cache_dtype="float32", device=device,
              kv_cache_memory=4 << 20, max_num_batched_tokens=budget,
              max_model_len=128)  # fmt: skip
    # Generation beside the embeddings: both come out right from the same steps.
    engine = llm.engine
    engine.add_request("gen", prompts[3], SamplingParams(max_tokens=4, temperature=0.0))
    outputs = llm.embed(prompts, use_tqdm=False)
    longer = prompts[2] + [11, 12, 13]  # its first blocks from the prefix cache
    outputs += llm.embed([longer], use_tqdm=False)
    prompts.append(longer)
    assert engine.stats().prefix_cache_hit_tokens >= 32
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = torch.nn.functional.normalize(reference(hf_model, prompt), dim=-1)
        got = torch.tensor(output.outputs.embedding)
        assert output.prompt_token_ids == prompt and output.outputs.hidden_size == len(expected)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    raw = llm.embed([prompts[1]], PoolingParams(normalize=False), use_tqdm=False)[0]
    torch.testing.assert_close(
        torch.tensor(raw.outputs.embedding), reference(hf_model, prompts[1]), atol=1e-4, rtol=1e-4
    )
    short = llm.embed([prompts[1]], PoolingParams(dimensions=8), use_tqdm=False)[0]
    expected = torch.nn.functional.normalize(reference(hf_model, prompts[1])[:8], dim=-1)
    torch.testing.assert_close(torch.tensor(short.outputs.embedding), expected, atol=1e-5,
                               rtol=1e-4)  # fmt: skip
    while engine.has_unfinished_requests:
        engine.step()
    assert engine.stats().num_blocks_used == 0


def sentence_transformers_checkpoint(
    model_dir: Path, tmp_path: Path, pooling: dict | str, normalize_module: bool = False
) -> Path:
    """A copy of ``model_dir`` with sentence-transformers' ``modules.json``: a Pooling module
    whose ``config.json`` is ``pooling`` (text: written as it is), and a Normalize module."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    modules = [
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize_module:
        modules.append({"idx": 2, "path": "2_Normalize", "type": NORMALIZE_MODULE})
    (model / "modules.json").write_text(json.dumps(modules))
    (model / "1_Pooling").mkdir()
    text = pooling if isinstance(pooling, str) else json.dumps(pooling)
    (model / "1_Pooling" / "config.json").write_text(text)
    return model


@pytest.mark.parametrize("normalize_module", [False, True])
def test_normalize_left_unset_is_what_the_checkpoints_modules_do(
    tiny_llama_dir: Path, tmp_path: Path, normalize_module: bool
) -> None:
    model = sentence_transformers_checkpoint(
        tiny_llama_dir, tmp_path, {"pooling_mode_lasttoken": True}, normalize_module
    )
    llm = LLM(model, dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
    prompt = [5, 6, 7, 8]

    def embed(normalize: bool | None) -> torch.Tensor:
        (out,) = llm.embed([prompt], PoolingParams(normalize=normalize), use_tqdm=False)
        return torch.tensor(out.outputs.embedding)

    unset, raw, normalized = embed(None), embed(False), embed(True)
    torch.testing.assert_close(unset, normalized if normalize_module else raw)
    assert abs(raw.norm().item() - 1) > 1e-3  # the two differ: the test could fail
    # score is a cosine whatever the model's default.
    (score,) = llm.score(["a b"], ["c d"])
    a, b = (torch.tensor(o.outputs.embedding) for o in llm.embed(["a b", "c d"], use_tqdm=False))
    assert score.outputs.score == pytest.approx(
        torch.nn.functional.cosine_similarity(a, b, dim=0).item(), abs=1e-5
    )


@pytest.mark.parametrize(
    ("pooling", "refused"),
    [
        ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, None),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}, "mean_tokens"),
        ({"pooling_mode_cls_token": True}, "cls_token"),
        ("{not json", "cannot be read"),
    ],
)
def test_a_declared_pooling_other_than_the_last_tokens_is_refused(
    tiny_llama_dir: Path, tmp_path: Path, pooling: dict | str, refused: str | None
) -> None:
    # A sentence-transformers checkpoint names its pooling: vectors of another pooling than
    # the one it was trained with would pass unnoticed, so its embeddings are refused; it still
    # generates.
    model = sentence_transformers_checkpoint(tiny_llama_dir, tmp_path, pooling)
    llm = LLM(model, dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
    if refused is None:
        assert len(llm.embed([[5, 6, 7]], use_tqdm=False)[0].outputs.embedding) > 0
    else:
        with pytest.raises(ValueError, match=refused) as error:
            llm.embed([[5, 6, 7]], use_tqdm=False)
        assert "1_Pooling/config.json" in str(error.value)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
    assert llm.engine.stats().num_blocks_used == 0


def test_dimensions_only_for_a_model_trained_for_them(
    tiny_llama_dir: Path, matryoshka_llama_dir: Path, tmp_path: Path
) -> None:
    """As vLLM: ``dimensions`` is refused for a model whose config.json declares no Matryoshka
    training, limited to ``matryoshka_dimensions`` where it lists them, any size up to the
    hidden size with ``is_matryoshka``."""
    plain = LLM(tiny_llama_dir, dtype="float32", max_model_len=64)
    with pytest.raises(SamplingParamError, match="does not support matryoshka") as error:
        plain.embed([[1, 2, 3]], PoolingParams(dimensions=8), use_tqdm=False)
    assert error.value.param == "dimensions"
    assert plain.engine.stats().num_waiting == 0, "refused before it was queued"
    listed = LLM(
        with_config(tiny_llama_dir, tmp_path / "listed", matryoshka_dimensions=[8, 16]),
        dtype="float32",
        max_model_len=64,
    )
    with pytest.raises(SamplingParamError, match=r"dimensions \[8, 16\] only, got 12"):
        listed.embed([[1, 2, 3]], PoolingParams(dimensions=12), use_tqdm=False)
    assert len(listed.embed([[1, 2, 3]], PoolingParams(dimensions=16))[0].outputs.embedding) == 16
    anything = LLM(matryoshka_llama_dir, dtype="float32", max_model_len=64)
    hidden_size = anything.engine.model_config.hidden_size
    assert len(anything.embed([[1, 2, 3]], PoolingParams(dimensions=12))[0].outputs.embedding) == 12
    with pytest.raises(SamplingParamError, match="hidden size") as error:
        anything.embed([[1, 2, 3]], PoolingParams(dimensions=hidden_size + 1), use_tqdm=False)
    assert error.value.param == "dimensions"
    bad = with_config(tiny_llama_dir, tmp_path / "bad", matryoshka_dimensions=[8, "16"])
    with pytest.raises(EngineConfigError, match="matryoshka_dimensions must be a list"):
        LLM(bad, dtype="float32", max_model_len=64)


def test_hf_overrides_declare_what_the_checkpoint_does_not(tiny_llama_dir: Path) -> None:
    """vLLM's ``hf_overrides``: ``is_matryoshka`` given at start-up instead of written into
    config.json; the overridden config is part of the KV layout's model id (two nodes with
    different overrides refuse each other's KV); a bad value is refused naming it."""
    overridden = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_model_len=64,
        hf_overrides={"is_matryoshka": True, "rope_scaling": None},
    )
    assert overridden.engine.model_config.matryoshka_dimensions == ()
    vector = overridden.embed([[1, 2, 3]], PoolingParams(dimensions=8))[0].outputs.embedding
    assert len(vector) == 8
    plain = LLM(tiny_llama_dir, dtype="float32", max_model_len=64)
    assert plain.engine.kv_layout.fingerprint != overridden.engine.kv_layout.fingerprint
    for bad in ("is_matryoshka", {1: True}, {"x": object()}):
        with pytest.raises(EngineConfigError, match="hf_overrides"):
            LLM(tiny_llama_dir, dtype="float32", max_model_len=64, hf_overrides=bad)
    # The overrides reach every part of the config read: a quantization_config too.
    quantized = {"quantization_config": {"quant_method": "awq"}}
    with pytest.raises(EngineConfigError, match="quant_method 'awq' is not supported"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=64, hf_overrides=quantized)
    # An override of a size the weights do not have is the checkpoint's refusal.
    with pytest.raises(ModelFileError, match="has shape .* expected .* from the model's config"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=64, hf_overrides={"hidden_size": 96})


def test_embedding_requests_are_checked(tiny_llama_dir: Path) -> None:
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=64)
    engine = llm.engine
    hidden_size = llm.engine.model_config.hidden_size
    for bad in ({"dimensions": 0}, {"dimensions": True}, {"normalize": "yes"}):
        with pytest.raises(SamplingParamError):
            PoolingParams(**bad)
    with pytest.raises(SamplingParamError, match="prompt_logprobs"):
        engine.add_request("p", [1, 2], SamplingParams(prompt_logprobs=1), pooling=PoolingParams())
    with pytest.raises(SamplingParamError, match="hold_kv"):
        engine.add_request("h", [1, 2], SamplingParams(), hold_kv=True, pooling=PoolingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([[1] * 65], use_tqdm=False)
    assert len(llm.embed([[1] * 64], use_tqdm=False)[0].outputs.embedding) == hidden_size
    long_prompt = list(range(10, 110))
    (kept,) = llm.embed([long_prompt], truncate_prompt_tokens=64, use_tqdm=False)
    (last,) = llm.embed([long_prompt[-64:]], use_tqdm=False)
    assert kept.prompt_token_ids == long_prompt[-64:]
    torch.testing.assert_close(
        torch.tensor(kept.outputs.embedding), torch.tensor(last.outputs.embedding)
    )
    with pytest.raises(SamplingParamError, match="truncate_prompt_tokens"):
        llm.embed([long_prompt], truncate_prompt_tokens=0, use_tqdm=False)
    assert engine.stats().num_blocks_used == 0 and not engine.has_unfinished_requests


@pytest.mark.parametrize("tied", [False, True])
def test_a_bare_decoder_checkpoint_embeds(tiny_model_factory, tmp_path: Path, tied: bool) -> None:
    """Embedding models are saved as the bare decoder (Qwen3-Embedding: Hugging Face's
    ``Qwen3Model``): weight names without ``model.``, and no lm_head. Such a checkpoint embeds as
    the full model does; untied, it has no output projection and refuses to generate."""
    source = tiny_model_factory("qwen3")
    bare = tmp_path / "bare"
    shutil.copytree(source, bare)
    weights = {}
    for path in sorted(bare.glob("*.safetensors")):
        weights.update(load_file(path))
        path.unlink()
    weights = {n.removeprefix("model."): t for n, t in weights.items() if n != "lm_head.weight"}
    save_file(weights, bare / "model.safetensors")
    config = json.loads((bare / "config.json").read_text())
    config["tie_word_embeddings"] = tied
    (bare / "config.json").write_text(json.dumps(config))
    (bare / "model.safetensors.index.json").unlink(missing_ok=True)

    prompt = [[5, 17, 300, 42, 9, 77]]
    want = LLM(source, dtype="float32").embed(prompt, use_tqdm=False)[0].outputs.embedding
    llm = LLM(bare, dtype="float32")
    got = llm.embed(prompt, use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    if tied:
        assert llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids
    else:
        with pytest.raises(ValueError, match="embeddings only"):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.engine.stats().num_blocks_used == 0


def test_score_is_the_cosine_of_the_embeddings(tiny_llama_dir: Path) -> None:
    """vLLM's ``LLM.score`` with an embedding model: one text against many, or pairs."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=64)
    texts = ["a cat", "a dog", "the stock market"]
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
    one_to_many = llm.score(texts[0], texts, use_tqdm=False)
    expected = [float(vectors[0] @ v) for v in vectors]
    assert [s.outputs.score for s in one_to_many] == pytest.approx(expected, abs=1e-5)
    assert one_to_many[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    pairs = llm.score(texts[:2], texts[1:], use_tqdm=False)
    assert [s.outputs.score for s in pairs] == pytest.approx(
        [float(vectors[0] @ vectors[1]), float(vectors[1] @ vectors[2])], abs=1e-5
    )
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3"):
        llm.score(texts[:2], texts, use_tqdm=False)
