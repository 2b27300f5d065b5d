"""Choosing an attention backend by name: the one module that knows every implementation.

``attention.py`` holds the interface and the portable torch path; ``native_attention.py`` (the
CPU kernel) and ``triton_attention.py`` (the GPU kernels) build on it. Choosing among them lives
here so that the interface never imports an implementation (no import cycle).
"""

from __future__ import annotations

import logging
import os

import torch

from services.models.attention import AttentionBackend, TorchPagedAttention
from services.models.layer_ops import LayerOps
from services.types import EngineConfigError

logger = logging.getLogger(__name__)


TRITON_LAYER_OPS_ENV = "PDSERVE_TRITON_LAYER_OPS"
"""Whether the Triton backend's elementwise steps run as fused Triton kernels
(``triton_layer_ops.py``): ``0`` never, ``1`` always, unset on a GPU only. On an H200 they took
a graphed decode step of the small model from 0.95 to 0.64 ms at batch 1 and the ~1B model's
from 1.84 to 1.31 ms. Under Triton's interpreter (the CPU suite) they run one program at a time
in Python, so there they are opt-in."""


def make_layer_ops(backend: AttentionBackend) -> LayerOps:
    """The fused native kernels beside the native attention backend (one library, one variant
    of the CPU); the fused Triton kernels beside the Triton backend (see
    ``TRITON_LAYER_OPS_ENV``); torch's ops otherwise."""
    from services.models.native_attention import NativePagedAttention
    from services.models.native_layer_ops import NativeLayerOps

    if isinstance(backend, NativePagedAttention):
        return NativeLayerOps(backend.isa)
    choice = os.environ.get(TRITON_LAYER_OPS_ENV, "")
    if choice not in ("", "0", "1"):
        raise EngineConfigError(f"{TRITON_LAYER_OPS_ENV} must be 0 or 1, got {choice!r}")
    if choice != "0":
        from services.models.triton_attention import INTERPRET, TritonPagedAttention

        if isinstance(backend, TritonPagedAttention) and (choice == "1" or not INTERPRET):
            from services.models.triton_layer_ops import TritonLayerOps

            return TritonLayerOps()
    return LayerOps()


def make_attention_backend(
    name: str, device: torch.device, *, block_size: int, scale: float
) -> AttentionBackend:
    """``torch``, ``native`` (raises if the CPU kernel cannot be built), ``triton`` (raises
    without CUDA, unless under ``TRITON_INTERPRET=1``) or ``auto``: triton on CUDA, native on
    CPU, the torch path where neither is available."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            from services.models.triton_attention import (
                TritonPagedAttention,
                triton_unavailable_reason,
            )
        except ImportError as exc:
            reason: str | None = f"cannot import triton: {exc}"
        else:
            reason = triton_unavailable_reason(device)
            if reason is None:
                return TritonPagedAttention(block_size, scale)
        if name == "triton":
            raise EngineConfigError(f"attention_backend 'triton' is unavailable: {reason}")
        logger.warning("Triton attention unavailable (%s); using the torch path", reason)
        return TorchPagedAttention(block_size, scale)
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return TorchPagedAttention(block_size, scale)
    try:
        from services.models.native_attention import NativePagedAttention
        from services.models.native_build import native_kernel_error
    except ImportError as exc:
        error: str | None = f"cannot import the native backend: {exc}"
    else:
        error = native_kernel_error()
        if error is None and device.type == "cpu":
            return NativePagedAttention(block_size, scale)
    if name == "native":
        raise EngineConfigError(f"attention_backend 'native' is unavailable: {error or 'CPU only'}")
    logger.warning("native CPU attention unavailable (%s); using the torch path", error)
    return TorchPagedAttention(block_size, scale)
