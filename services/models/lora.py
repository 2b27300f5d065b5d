"""LoRA adapters on the decoder's projections: PEFT's files read, and each adapter's low-rank
delta added to a projection's output for the rows of the requests that run with it.

Why stacked slots: one step batches requests of several adapters and of none, and a decode
step on a GPU replays a CUDA graph whose kernels are fixed at capture. A projection computes ``x
W^T`` for every row on its usual kernel (the packed and few-row ones stay as they are), then adds
``((x A) * m) B``: ``A`` and ``B`` hold every loaded adapter's weights side by side (``s`` =
``lora_alpha / r`` folded into ``B`` at loading), and the step's mask ``m`` keeps, for each row,
the columns of its request's adapter. The fused projections take their parts' deltas in their
column ranges (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up). With adapters in a step,
gate and up are computed unactivated and SiLU-and-mul applied after the deltas (the packed
kernels' fused epilogue would apply it before).

Life cycle:

1. ``install_lora``: once, after ``pack_linears``: each layer's projections are wrapped
   (``LoraProjection``, ``LoraGateUp``), each with its stacked weights (``LoraDeltas``)
   registered in one ``LoraState``.
2. ``load_adapter`` reads a PEFT directory into a ``LoraAdapter`` (refusing what it cannot
   apply, naming it); ``LoraState.add`` copies it into a slot, ``remove`` zeroes the slot.
3. Every forward: the runner sets ``LoraState.mask`` from each row's slot (``step``) before
   the model runs and clears it after, whatever happens; a captured decode graph computes the
   mask from its static slot row.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
    r]`` and ``s B^T`` ``[r, out]``, in the model's dtype (on the device ``load_adapter`` was
    given; ``LoraState.add`` copies them into the model's slots)."""

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


class LoraState:
    """The adapters of one model in ``max_loras`` slots, and the forward pass's row mask.

    Why slots: a step batches requests of several adapters and of none, and a decode step on a
    GPU is a replayed CUDA graph, whose kernels and shapes are fixed when it is captured. So each
    wrapped projection holds every slot's weights stacked (``LoraDeltas``), and a row's delta is
    ``((x A) * m) B`` with a mask ``m`` that keeps the columns of the row's slot: the same two
    GEMMs whatever the mix of adapters, reading weights that loading writes in place. K =
    ``max_loras * max_rank`` columns; an adapter of lower rank leaves the rest of its slot 0.

    Life cycle: built before ``install_lora`` (which registers every wrapper); ``add`` writes an
    adapter into a free slot of every wrapper and ``remove`` zeroes it (between steps: the
    engine holds at most ``max_loras``); ``step`` sets the mask for one forward pass and clears
    it after, whatever happens."""

    def __init__(
        self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots: dict[str, int] = {}
        self.projections: list[LoraDeltas] = []
        # [K]: the slot of each stacked column.
        self._column_slots = torch.arange(max_loras * max_rank, device=device) // max_rank
        self.mask: torch.Tensor | None = None
        """During a forward with adapter rows: ``[num_tokens, 3 K]``, 1 where a column belongs
        to the row's slot, tiled for up to three fused parts (a projection of P parts reads
        ``[:, :P K]``); None: no row runs with an adapter and the deltas are skipped."""

    @property
    def columns(self) -> int:
        """K: the stacked columns of one part."""
        return self.max_loras * self.max_rank

    def slot_of(self, name: str | None) -> int:
        """The slot of adapter ``name``, -1 for None (the base model)."""
        return -1 if name is None else self.slots[name]

    def add(self, name: str, adapter: LoraAdapter) -> None:
        """``adapter`` under ``name`` in a free slot (its own, replacing one of that name)."""
        slot = self.slots.get(name)
        if slot is None:
            free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
            if not free:
                raise ValueError(f"all {self.max_loras} LoRA slots hold adapters")
            slot = free[0]
        for projection in self.projections:
            projection.write_slot(slot, adapter)
        self.adapters[name] = adapter
        self.slots[name] = slot

    def remove(self, name: str) -> bool:
        """Drop adapter ``name`` and zero its slot; False where none is loaded under it."""
        slot = self.slots.pop(name, None)
        if slot is None:
            return False
        del self.adapters[name]
        for projection in self.projections:
            projection.write_slot(slot, None)
        return True

    @contextmanager
    def step(self, row_slots: torch.Tensor | None) -> Iterator[None]:
        """``mask`` from ``row_slots`` (int64 ``[num_tokens]`` on the device, each row's slot or
        -1) while the block runs; None: no row runs with an adapter. Under CUDA graph capture
        the mask is computed inside the graph, from the static tensor ``row_slots``."""
        if row_slots is None:
            self.mask = None
        else:
            mask = (row_slots[:, None] == self._column_slots).to(self.dtype)  # [num_tokens, K]
            self.mask = mask.repeat(1, 3)
        try:
            yield
        finally:
            self.mask = None


class LoraDeltas:
    """One projection's stacked adapter weights: ``a`` ``[in, P K]`` (A^T of part p's slot s in
    columns ``p K + s R`` onwards) and ``b`` ``[P K, out]`` (s B^T in the same rows, in part p's
    output columns only: block-diagonal), for its P fused parts."""

    def __init__(
        self,
        state: LoraState,
        layer: int,
        in_features: int,
        parts: tuple[tuple[str, int, int], ...],
    ) -> None:
        self.state = state
        self.layer = layer
        self.parts = parts
        """(PEFT module name, first output column, end column) of each part it fuses."""
        width = len(parts) * state.columns
        out_features = parts[-1][2]
        self.a = torch.zeros(in_features, width, dtype=state.dtype, device=state.device)
        self.b = torch.zeros(width, out_features, dtype=state.dtype, device=state.device)
        state.projections.append(self)

    def write_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Slot ``slot`` of each part: ``adapter``'s weights (zero where it has none)."""
        rank = self.state.max_rank
        for index, (name, begin, end) in enumerate(self.parts):
            first = index * self.state.columns + slot * rank
            self.a[:, first : first + rank].zero_()
            self.b[first : first + rank].zero_()
            delta = None if adapter is None else adapter.deltas.get((self.layer, name))
            if delta is not None:
                a_t, b_t = delta  # [in, r], [r, end - begin]
                r = a_t.shape[1]
                self.a[:, first : first + r].copy_(a_t)
                self.b[first : first + r, begin:end].copy_(b_t)

    def add_to(self, x: torch.Tensor, out: torch.Tensor, mask: torch.Tensor) -> None:
        """In place: ``out += ((x A) * mask) B``. x: [num_tokens, in]; out: [num_tokens, out];
        mask: the state's ``[num_tokens, 3 K]``."""
        width = self.a.shape[1]
        out.addmm_((x @ self.a) * mask[:, :width], self.b)


class LoraProjection(nn.Module):
    """A projection (``nn.Linear`` or ``PackedLinear``) with its adapters' deltas added."""

    def __init__(self, base: nn.Module, deltas: LoraDeltas) -> None:
        super().__init__()
        self.base = base
        self.deltas = deltas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        mask = self.deltas.state.mask
        if mask is not None:
            self.deltas.add_to(x, out, mask)
        return out


class LoraGateUp(nn.Module):
    """``silu(gate) * up`` of a SwiGLU MLP's fused ``gate_up_proj`` (a ``PackedSiluGateUp``,
    whose kernels apply the activation, or a plain ``nn.Linear``), with the adapters' deltas
    added to gate and up before the activation."""

    def __init__(self, base: nn.Module, deltas: LoraDeltas, ops: LayerOps) -> None:
        super().__init__()
        self.base = base
        self.deltas = deltas
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, intermediate]."""
        base = self.base
        mask = self.deltas.state.mask
        if mask is None:
            if isinstance(base, PackedSiluGateUp):
                return base(x)
            return self.ops.silu_and_mul(base(x))
        gate_up = base.gate_and_up(x) if isinstance(base, PackedSiluGateUp) else base(x)
        self.deltas.add_to(x, gate_up, mask)
        return self.ops.silu_and_mul(gate_up)


def install_lora(model: nn.Module, config: ModelConfig, state: LoraState, ops: LayerOps) -> None:
    """Wrap each decoder layer's projections of ``model`` (a ``LlamaForCausalLM``) so that they
    add ``state``'s deltas; the embedding and the lm_head are not adapted."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    for index, layer in enumerate(model.model.layers):  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (
            ("q_proj", 0, q_size),
            ("k_proj", q_size, q_size + kv_size),
            ("v_proj", q_size + kv_size, q_size + 2 * kv_size),
        )
        attn.qkv_proj = LoraProjection(attn.qkv_proj, LoraDeltas(state, index, hidden, qkv))
        attn.o_proj = LoraProjection(
            attn.o_proj, LoraDeltas(state, index, q_size, (("o_proj", 0, hidden),))
        )
        gate_up = (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))
        mlp.gate_up_proj = LoraGateUp(
            mlp.gate_up_proj, LoraDeltas(state, index, hidden, gate_up), ops
        )
        mlp.down_proj = LoraProjection(
            mlp.down_proj, LoraDeltas(state, index, inter, (("down_proj", 0, hidden),))
        )
