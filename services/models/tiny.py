"""Build small random-weight Hugging Face checkpoints, offline and deterministically.

The engine's tests and the laptop demo need a real checkpoint without a model hub: this module
writes one in the exact layout Hugging Face writes (``config.json``, ``model.safetensors`` or
shards with an index, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``) for the Llama-family architectures the engine serves.

- The tokenizer is a byte-level BPE trained here on a synthetic corpus drawn from a fixed seed,
  so every build gets the same tokenizer whatever the weight seed. Rare multi-byte characters
  (CJK, emoji) stay split across byte tokens, as they do in real vocabularies.
- Weights come from a ``torch.Generator`` seeded with ``seed``. They are scaled so activations
  keep unit size and logits spread with a standard deviation near 4: Hugging Face's own init
  (std 0.02) gives near-uniform logits, where greedy argmax flips on rounding noise and parity
  tests against Hugging Face become flaky.
- The model's ``vocab_size`` is the target size; when BPE training runs out of merges first, the
  rows past the tokenizer's length are padding no text encodes to (real checkpoints do the same).

Run ``python -m services.models.tiny OUT_DIR --arch qwen3`` or call :func:`build_tiny_model`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GenerationConfig,
    GraniteConfig,
    GraniteMoeConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    OlmoeConfig,
    Phi3Config,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SiglipVisionConfig,
    SmolLM3Config,
)
from transformers.utils import logging as hf_logging

logger = logging.getLogger(__name__)

ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "smollm3",
    "granite",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "olmo2",
    "gemma3",
    "gemma3_mm",
    "granitemoe",
    "olmoe",
    "gemma2",
)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Trained first, so their ids are 0..4 in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

# ChatML, opened with BOS as Llama 3 does. Templates carry their own special tokens, so a
# rendered prompt is encoded with add_special_tokens=False (HF's apply_chat_template does that).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The tokenizer does not depend on the weight seed: one vocabulary for every build of a size.
_CORPUS_SEED = 1234
# Std of the logits the output projection is scaled for (hidden states have unit rms there).
_LOGIT_STD = 4.0
_BIAS_STD = 0.1


@dataclass(frozen=True)
class ModelSize:
    """Shape of one model size; every architecture uses the same numbers."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    """Target vocabulary: the BPE trainer aims for it; the model's embedding has exactly this."""
    max_position_embeddings: int
    num_pseudo_words: int
    """Distinct invented words in the corpus; they give BPE enough merges to reach vocab_size."""
    num_sentences: int
    """Sentences in the training corpus."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=4096,
        max_position_embeddings=2048,
        num_pseudo_words=3000,
        num_sentences=4000,
    ),
    "small": ModelSize(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=4096,
        num_pseudo_words=40000,
        num_sentences=60000,
    ),
    # Llama-3.2-1B's shape with the small size's vocabulary (1.1B parameters): the GPU
    # benchmarks' "~1B" model, where a decode step is bound by reading weights.
    "1b": ModelSize(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=32000,
        max_position_embeddings=4096,
        num_pseudo_words=40000,
        num_sentences=60000,
    ),
}

_COMMON_WORDS = (
    "the of and to in is was that for it with as on be at by this had not are but from or have "
    "an they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three small large model token server request "
    "cache block batch decode prefill stream gateway node queue memory page layer head vector "
    "answer question hello world please thank data number value river mountain city house light "
    "water music garden window morning evening story letter paper table"
).split()
_ONSETS = ("", *"b c d f g h k l m n p r s t v w z br ch cl dr fl gr pl qu sh st th tr".split())
_VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "oo", "ou", "ie")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "ng", "st", "nd", "ck", "x")
_PUNCTUATION = (".", ".", ".", "!", "?", ",", ";", ":", " -", "...")
# Frequent multi-byte text that BPE learns as whole tokens.
_MULTIBYTE_WORDS = tuple(
    "café über naïve résumé straße 日本語 東京 こんにちは Привет αβγ 🙂 🚀 → €5".split()
)


def _pseudo_word(rng: random.Random) -> str:
    num_syllables = rng.choice((1, 2, 2, 3, 3, 4))
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(num_syllables)
    )


def _rare_char(rng: random.Random) -> str:
    # Drawn from thousands of code points, each is too rare to earn a merge: it stays as bytes.
    if rng.random() < 0.5:
        return chr(rng.randint(0x4E00, 0x9FFF))  # CJK unified ideographs, 3 bytes
    return chr(rng.randint(0x1F300, 0x1F5FF))  # pictographs, 4 bytes


def _synthetic_corpus(size: ModelSize, seed: int = _CORPUS_SEED) -> list[str]:
    """English-ish sentences mixing common words, invented words, numbers and non-ASCII text."""
    rng = random.Random(seed)
    lexicon = [_pseudo_word(rng) for _ in range(size.num_pseudo_words)]
    # Zipf-like weights make frequencies uneven, so merges come out in a natural order.
    common_weights = [1.0 / (rank + 1) for rank in range(len(_COMMON_WORDS))]
    # Every invented word appears at least once, so the lexicon's merges are all reachable.
    unused = list(lexicon)
    rng.shuffle(unused)
    sentences = []
    for _ in range(size.num_sentences):
        words = []
        for _ in range(rng.randint(4, 16)):
            roll = rng.random()
            if roll < 0.55:
                words.append(rng.choices(_COMMON_WORDS, weights=common_weights)[0])
            elif roll < 0.85:
                words.append(unused.pop() if unused else rng.choice(lexicon))
            elif roll < 0.92:
                words.append(str(rng.choice((rng.randint(0, 99), rng.randint(0, 99999)))))
            elif roll < 0.97:
                words.append(rng.choice(_MULTIBYTE_WORDS))
            elif roll < 0.99:
                words.append(_rare_char(rng))
            else:
                words.append(f"{rng.randint(1, 12)}/{rng.randint(1, 28)}/{rng.randint(1990, 2030)}")
        text = " ".join(words)
        text = text[0].upper() + text[1:] + rng.choice(_PUNCTUATION)
        if rng.random() < 0.1:
            text = f'"{text}"'
        sentences.append(text)
    sentences.extend(unused)
    return sentences


def build_tokenizer(
    vocab_size: int, corpus: list[str], model_max_length: int
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it as a Hugging Face tokenizer.

    Its length may fall short of ``vocab_size`` when the corpus runs out of merges.
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        add_bos_token=True,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def build_config(
    arch: str, size: ModelSize, tokenizer: PreTrainedTokenizerFast, vocab_size: int
) -> PreTrainedConfig:
    """The Hugging Face config for ``arch`` at ``size``, with ids taken from ``tokenizer``."""
    common = dict(
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        intermediate_size=size.intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=size.max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    default_rope = {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "llama":
        # Llama 3.1 frequency scaling; the original context is shortened so the tiny model's
        # 2048 positions reach past it and the scaled frequencies matter.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        }
        return LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if arch == "qwen2":
        # Qwen2 always carries q/k/v biases.
        return Qwen2Config(**common, rope_parameters=default_rope, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(
            **common,
            rope_parameters=default_rope,
            head_dim=size.head_dim,
            tie_word_embeddings=False,
        )
    if arch == "mistral":
        return MistralConfig(
            **common,
            rope_parameters=default_rope,
            head_dim=size.head_dim,
            sliding_window=None,
            tie_word_embeddings=False,
        )
    if arch == "smollm3":
        # Every fourth layer without RoPE, as SmolLM3-3B, but from the second (transformers'
        # default leaves out every fourth from the fourth): the list is what config.json says.
        no_rope = [0 if i % 4 == 1 else 1 for i in range(size.num_hidden_layers)]
        return SmolLM3Config(
            **common,
            rope_parameters=default_rope,
            tie_word_embeddings=True,
            no_rope_layers=no_rope,
        )
    # Granite 3's multipliers, other than 1 so that each one matters (the attention scale
    # 1 / head_dim, not its root, as Granite's). Granite 3 ties its embeddings, but with random
    # weights a tied, multiplied embedding drowns the layers' outputs in the residual stream,
    # and the model repeats its last input token whatever they compute: untied here.
    granite = {
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 1.0 / size.head_dim,
        "logits_scaling": 2.0,
        "tie_word_embeddings": False,
    }
    if arch == "granite":
        return GraniteConfig(**common, rope_parameters=default_rope, **granite)
    if arch == "phi3":
        # Phi-3-mini-4k's shape of config (its sliding window aside); the checkpoint's
        # qkv_proj and gate_up_proj come fused.
        return Phi3Config(
            **common, rope_parameters=default_rope, sliding_window=None, tie_word_embeddings=False
        )
    if arch == "mixtral":
        # Four experts, two a token, each of intermediate_size.
        return MixtralConfig(
            **common,
            rope_parameters=default_rope,
            head_dim=size.head_dim,
            sliding_window=None,
            tie_word_embeddings=False,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    if arch == "qwen3_moe":
        # Eight experts of a quarter of intermediate_size, two a token, their probabilities
        # renormalized (as Qwen3-30B-A3B); the second layer keeps a dense MLP.
        return Qwen3MoeConfig(
            **common,
            rope_parameters=default_rope,
            head_dim=size.head_dim,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=size.intermediate_size // 4,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if arch == "granitemoe":
        # Granite 3's small MoE (granite-3.1-1b-a400m's shape of config): Granite's multipliers
        # (as the dense granite's) and four experts of a quarter size, two a token.
        return GraniteMoeConfig(
            **{**common, "intermediate_size": size.intermediate_size // 4},
            rope_parameters=default_rope,
            **granite,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    if arch == "gemma3_mm":
        # Gemma 3 from 4B up: the text model beside a (tiny) vision tower, as
        # Gemma3ForConditionalGeneration saves it; its global layers' RoPE scaled linearly (8).
        text = build_config("gemma3", size, tokenizer, vocab_size).to_dict()
        text["rope_parameters"]["full_attention"] = {
            "rope_type": "linear",
            "factor": 8.0,
            "rope_theta": 1_000_000.0,
        }
        vision = SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        return Gemma3Config(
            text_config=text,
            vision_config=vision.to_dict(),
            mm_tokens_per_image=4,
            boi_token_index=vocab_size - 3,
            eoi_token_index=vocab_size - 2,
            image_token_index=vocab_size - 1,
            tie_word_embeddings=False,
            dtype="float32",
        )
    if arch == "gemma3":
        # Every other layer global, the rest attending to their last 8 tokens only, so that
        # the window shows in short prompts; transformers' two RoPE bases (10k local, 1M global).
        return Gemma3TextConfig(
            **common,
            head_dim=size.head_dim,
            sliding_window=8,
            layer_types=[
                "full_attention" if i % 2 else "sliding_attention"
                for i in range(size.num_hidden_layers)
            ],
            query_pre_attn_scalar=2 * size.head_dim,  # a scale other than 1 / sqrt(head_dim)
            # Untied, as Granite's above: a tied embedding times sqrt(hidden_size) drowns the
            # layers' outputs, and the random model repeats its last token.
            tie_word_embeddings=False,
        )
    if arch == "olmoe":
        # OLMoE-1B-7B's shape of routing: eight experts of a quarter of intermediate_size, two a
        # token, their probabilities not renormalized; Q/K norms across the heads.
        olmoe = {**common, "intermediate_size": size.intermediate_size // 4}
        return OlmoeConfig(
            **olmoe,
            rope_parameters=default_rope,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
    if arch == "gemma2":
        # Gemma 3's tiny shape, without its Q/K norms and second RoPE base, and with caps small
        # enough to bend a random model's scores (2) and logits (3): Gemma 2 9B's are 50 and 30.
        return Gemma2Config(
            **common,
            head_dim=size.head_dim,
            sliding_window=8,
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(size.num_hidden_layers)
            ],
            query_pre_attn_scalar=2 * size.head_dim,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            rope_parameters=default_rope,
            tie_word_embeddings=False,
        )
    if arch == "olmo2":
        return Olmo2Config(**common, rope_parameters=default_rope, tie_word_embeddings=False)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


@torch.no_grad()
def _init_weights(model: PreTrainedModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    text = model.config.get_text_config()  # a multimodal model's language model's
    hidden_size = text.hidden_size
    tied = model.config.tie_word_embeddings
    gemma = text.model_type in ("gemma3_text", "gemma2")
    # Gemma multiplies its embeddings by sqrt(hidden_size): untied, unit-scale rows after it.
    embedding_scale = 1.0 / math.sqrt(hidden_size) if gemma else 1.0
    # A final-norm hidden state has unit rms, so this std gives logits of std _LOGIT_STD (after
    # Granite's division by logits_scaling).
    output_std = _LOGIT_STD * getattr(model.config, "logits_scaling", 1.0) / math.sqrt(hidden_size)
    # named_parameters() yields a tied matrix once, under the embedding's name.
    for name, param in model.named_parameters():
        if "vision_tower." in name or "multi_modal_projector." in name:
            std = 0.02  # never run: text in, text out
        elif name.endswith("norm.weight"):
            std = None  # RMSNorm gains, q_norm/k_norm included
            if gemma:  # Gemma's norms scale by 1 + weight: random offsets, so that each shows
                std = 0.1
        elif name.endswith("embed_tokens.weight"):
            # Tied, the matrix serves as the output projection too; the first RMSNorm rescales
            # the small input embeddings, so only the output role constrains its scale.
            std = output_std if tied else embedding_scale
        elif name.endswith("lm_head.weight"):
            std = output_std
        elif name.endswith(".bias"):
            std = _BIAS_STD
        elif param.dim() in (2, 3):
            # Variance 1/fan_in keeps every projection's output at unit scale (a mixture of
            # experts' stacked [experts, out, in] weights too; its router's logits too).
            std = 1.0 / math.sqrt(param.shape[-1])
        else:
            raise AssertionError(f"no init rule for parameter {name} of shape {tuple(param.shape)}")
        if std is None:
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * std)


def build_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    max_shard_size: str | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` at ``size`` into ``out_dir``; return it.

    ``max_shard_size`` (e.g. ``"2MB"``) writes shards and ``model.safetensors.index.json``.
    ``vocab_size`` overrides the size's target vocabulary.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {tuple(SIZES)}")
    model_size = SIZES[size]
    target_vocab = model_size.vocab_size if vocab_size is None else vocab_size
    if target_vocab < 512:
        raise ValueError(f"vocab_size {target_vocab} is too small: 256 bytes and 5 special tokens")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(
        target_vocab, _synthetic_corpus(model_size), model_size.max_position_embeddings
    )
    if len(tokenizer) < target_vocab:
        logger.info(
            "BPE reached %d of %d tokens; padding the model's vocab", len(tokenizer), target_vocab
        )
    config = build_config(arch, model_size, tokenizer, target_vocab)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **save_kwargs)
    # The chat template goes inside tokenizer_config.json, where every reader looks for it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps(special_tokens_map, indent=2) + "\n"
    )
    return out_dir


def _num_parameters(out_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted(out_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                total += math.prod(f.get_slice(key).get_shape())
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--max-shard-size", default=None, help='e.g. "2MB"; default: one file')
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    hf_logging.disable_progress_bar()

    start = time.perf_counter()
    out_dir = build_tiny_model(
        args.out_dir,
        arch=args.arch,
        size=args.size,
        seed=args.seed,
        max_shard_size=args.max_shard_size,
        vocab_size=args.vocab_size,
    )
    elapsed = time.perf_counter() - start
    num_params = _num_parameters(out_dir)
    print(f"{out_dir}: {args.arch}/{args.size}, {num_params:,} parameters, built in {elapsed:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
