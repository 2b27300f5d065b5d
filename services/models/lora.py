"""LoRA adapters on the decoder's projections: PEFT's files read, and each adapter's low-rank
delta added to a projection's output for the rows of the requests that run with it.

Why per row: one step batches requests of several adapters and of none. A projection computes
``x W^T`` for every row on its usual kernel (the packed and few-row ones stay as they are), then
for each adapter in the step adds ``(x[rows] A^T) (s B)^T`` to its rows: two small GEMMs of rank
``r`` (``s`` = ``lora_alpha / r``, folded into ``B`` at loading). The fused projections take
their parts' deltas in their column ranges (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up).
With deltas on gate or up, that step computes the two unactivated and applies SiLU-and-mul after
the deltas (the packed kernels' fused epilogue would apply it before).

Life cycle:

1. ``install_lora``: once, after ``pack_linears``: each layer's projections are wrapped
   (``LoraProjection``, ``LoraGateUp``), all reading one ``LoraState``.
2. ``load_adapter`` reads a PEFT directory into a ``LoraAdapter`` (refusing what it cannot
   apply, naming it); ``LoraState.adapters[name]`` holds it until the engine removes it.
3. Every forward: the runner sets ``LoraState.batch`` (per adapter, the rows of its requests)
   before the model runs and empties it after, whatever happens.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from services.models.config import ModelConfig
from services.models.layer_ops import LayerOps
from services.models.packed_linear import PackedSiluGateUp

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may adapt (PEFT's module names in Llama-family checkpoints)."""

_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight"
)


class LoraAdapterError(ValueError):
    """An adapter the engine cannot apply: the message names the file and what is wrong."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights, ready to multiply: per (layer, projection name), ``A^T`` ``[in,
    r]`` and ``s B^T`` ``[r, out]``, in the model's dtype and on its device."""

    path: Path
    rank: int
    """The largest rank of its projections."""
    deltas: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str = ""
    """A hash of its two files: a prefill and a decode node must have loaded the same adapter
    under a name (the KV one computes, the other decodes on)."""

    @property
    def targets(self) -> list[str]:
        """The projection names it adapts, in ``TARGETS``' order."""
        names = {name for _, name in self.deltas}
        return [name for name in TARGETS if name in names]


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _read_config(path: Path) -> tuple[dict[str, object], float]:
    """The adapter's ``adapter_config.json``, and its ``lora_alpha``."""
    config_file = path / ADAPTER_CONFIG
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraAdapterError(f"{path}: no {ADAPTER_CONFIG} (a PEFT adapter directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraAdapterError(f"{config_file}: not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{config_file}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraAdapterError(f"{config_file}: peft_type {peft_type!r}: only LORA is applied")
    # PEFT options that change the arithmetic: each refused rather than applied wrongly.
    for name, why in (
        ("use_dora", "DoRA's magnitude vectors"),
        ("fan_in_fan_out", "transposed (Conv1D) weights"),
        ("modules_to_save", "whole modules saved beside the adapter"),
        ("alpha_pattern", "per-module lora_alpha"),
        ("layer_replication", "replicated layers"),
        ("lora_bias", "LoRA biases"),
    ):
        if config.get(name):
            raise LoraAdapterError(f"{config_file}: {name} ({why}) is not supported")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"{config_file}: bias {config['bias']!r}: only 'none' is applied")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoraAdapterError(f"{config_file}: lora_alpha must be a number, got {alpha!r}")
    return config, float(alpha)


def load_adapter(
    path: Path,
    model_config: ModelConfig,
    *,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraAdapter:
    """A PEFT LoRA adapter directory as a ``LoraAdapter`` for this model; ``LoraAdapterError``
    for anything it cannot apply (a missing file, another model's shapes, a rank above
    ``max_rank``, a module or option it does not adapt)."""
    from safetensors.torch import load_file

    path = Path(path)
    config, alpha = _read_config(path)
    weights_file = path / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        why = ""
        if (path / "adapter_model.bin").is_file():
            why = " (its adapter_model.bin is a pickle, which is never loaded)"
        raise LoraAdapterError(f"{path}: no {ADAPTER_WEIGHTS}{why}")
    try:
        tensors = load_file(weights_file)
    except Exception as exc:  # safetensors raises its own error types for a bad file
        raise LoraAdapterError(f"{weights_file}: not a safetensors file: {exc}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise LoraAdapterError(
                f"{weights_file}: {key}: only the LoRA A/B weights of the decoder layers' "
                f"{', '.join(TARGETS)} are applied"
            )
        layer, name, part = int(match[1]), match[2], match[3]
        if layer >= model_config.num_layers:
            raise LoraAdapterError(
                f"{weights_file}: {key}: the model has {model_config.num_layers} layers"
            )
        pairs.setdefault((layer, name), {})[part] = tensor
    if not pairs:
        raise LoraAdapterError(f"{weights_file}: no LoRA weights")
    shapes = projection_shapes(model_config)
    rslora = bool(config.get("use_rslora"))
    deltas: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    max_seen = 0
    for (layer, name), pair in sorted(pairs.items()):
        where = f"{weights_file}: layer {layer} {name}"
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"{where}: lora_A and lora_B must both be given")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[name]
        rank = a.shape[0] if a.dim() == 2 else -1
        if a.shape != (rank, in_features) or b.shape != (out_features, rank) or rank < 1:
            raise LoraAdapterError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                f"[r, {in_features}] and [{out_features}, r]: an adapter of another model?"
            )
        if rank > max_rank:
            raise LoraAdapterError(f"{where}: rank {rank} is above max_lora_rank {max_rank}")
        max_seen = max(max_seen, rank)
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        # A^T: [in, r]; s B^T: [r, out]. Scaled in fp32, then cast once.
        a_t = a.float().t().contiguous().to(dtype=dtype, device=device)
        b_t = (b.float() * scale).t().contiguous().to(dtype=dtype, device=device)
        deltas[(layer, name)] = (a_t, b_t)
    return LoraAdapter(
        path=path, rank=max_seen, deltas=deltas, fingerprint=_fingerprint(path, weights_file)
    )


def _fingerprint(path: Path, weights_file: Path) -> str:
    digest = hashlib.sha256((path / ADAPTER_CONFIG).read_bytes())
    with weights_file.open("rb") as weights:
        digest.update(hashlib.file_digest(weights, "sha256").digest())
    return digest.hexdigest()[:16]


@dataclass
class LoraState:
    """What every LoRA wrapper of one model reads: the loaded adapters, and the step's rows."""

    adapters: dict[str, LoraAdapter] = field(default_factory=dict)
    batch: list[tuple[LoraAdapter, torch.Tensor]] = field(default_factory=list)
    """This forward's adapters, each with its rows (int64 ``[n]`` indices into the step's
    flat tokens); empty: no row runs with an adapter."""

    @contextmanager
    def rows(self, groups: dict[str, list[int]], device: torch.device) -> Iterator[None]:
        """``batch`` from ``groups`` (adapter name -> rows) while the block runs."""
        self.batch = [
            (self.adapters[name], torch.tensor(rows, dtype=torch.int64, device=device))
            for name, rows in groups.items()
            if rows
        ]
        try:
            yield
        finally:
            self.batch = []


def _add_deltas(
    state: LoraState,
    layer: int,
    parts: tuple[tuple[str, int, int], ...],
    x: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """In place: ``out[rows, begin:end] += x[rows] A^T (s B^T)`` for each adapter of the step
    and each of ``parts`` (name, begin, end) it adapts. x: [num_tokens, in]; out: [num_tokens,
    out_features]."""
    for adapter, rows in state.batch:
        selected: torch.Tensor | None = None
        for name, begin, end in parts:
            delta = adapter.deltas.get((layer, name))
            if delta is None:
                continue
            if selected is None:
                selected = x.index_select(0, rows)  # [n, in]
            a_t, b_t = delta
            out[:, begin:end].index_add_(0, rows, (selected @ a_t) @ b_t)


class LoraProjection(nn.Module):
    """A projection (``nn.Linear`` or ``PackedLinear``) with its adapters' deltas added."""

    def __init__(
        self, base: nn.Module, state: LoraState, layer: int, parts: tuple[tuple[str, int, int], ...]
    ) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.layer = layer
        self.parts = parts
        """(PEFT module name, first output column, end column) of each part it fuses."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.state.batch:
            _add_deltas(self.state, self.layer, self.parts, x, out)
        return out


class LoraGateUp(nn.Module):
    """``silu(gate) * up`` of a SwiGLU MLP's fused ``gate_up_proj`` (a ``PackedSiluGateUp``,
    whose kernels apply the activation, or a plain ``nn.Linear``), with the adapters' deltas
    added to gate and up before the activation."""

    def __init__(
        self, base: nn.Module, state: LoraState, layer: int, intermediate: int, ops: LayerOps
    ) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.layer = layer
        self.ops = ops
        self.parts = (("gate_proj", 0, intermediate), ("up_proj", intermediate, 2 * intermediate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, intermediate]."""
        base = self.base
        if not self.state.batch:
            if isinstance(base, PackedSiluGateUp):
                return base(x)
            return self.ops.silu_and_mul(base(x))
        gate_up = base.gate_and_up(x) if isinstance(base, PackedSiluGateUp) else base(x)
        _add_deltas(self.state, self.layer, self.parts, x, gate_up)
        return self.ops.silu_and_mul(gate_up)


def install_lora(model: nn.Module, config: ModelConfig, state: LoraState, ops: LayerOps) -> None:
    """Wrap each decoder layer's projections of ``model`` (a ``LlamaForCausalLM``) so that they
    read ``state``; the embedding and the lm_head are not adapted."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    for index, layer in enumerate(model.model.layers):  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = LoraProjection(
            attn.qkv_proj,
            state,
            index,
            (
                ("q_proj", 0, q_size),
                ("k_proj", q_size, q_size + kv_size),
                ("v_proj", q_size + kv_size, q_size + 2 * kv_size),
            ),
        )
        attn.o_proj = LoraProjection(attn.o_proj, state, index, (("o_proj", 0, hidden),))
        mlp.gate_up_proj = LoraGateUp(mlp.gate_up_proj, state, index, inter, ops)
        mlp.down_proj = LoraProjection(mlp.down_proj, state, index, (("down_proj", 0, hidden),))
