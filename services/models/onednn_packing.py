"""Reading a weight that oneDNN packed (``mkldnn._reorder_linear_weight``), for pdserve's own
few-row kernels (``amx_linear.py``, ``fp32_linear.py``), which multiply that very buffer.

oneDNN's layout is its choice, not a promise: a kernel reads a packed buffer only after
``verified_address`` compared every packed element with the plain weight, through the layout the
kernel expects. Stateless: the packed tensor is the caller's to hold while a kernel reads it.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

_CTYPES = {torch.int16: ctypes.c_int16, torch.int32: ctypes.c_int32}


def packed_buffer(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The packed weight's buffer as a flat ``dtype`` tensor (int16 for bf16 weights, int32 for
    fp32: compared as bits, so NaNs compare too) over the same memory, no copy."""
    address = torch.ops.mkldnn.data_ptr(packed)
    length = torch.ops.mkldnn._nbytes(packed) // dtype.itemsize
    return torch.frombuffer((_CTYPES[dtype] * length).from_address(address), dtype=dtype)


def verified_address(
    weight: torch.Tensor,
    packed: torch.Tensor,
    in_layout: Callable[[torch.Tensor, torch.Tensor], bool],
) -> int | None:
    """The address of ``packed``'s buffer when ``in_layout(weight, packed)`` says it holds the
    plain ``weight`` as the kernel expects, else None (logged at debug: another oneDNN version
    or CPU, a padded shape, or a torch without ``mkldnn.data_ptr``)."""
    try:
        matches = in_layout(weight, packed)
    except (AttributeError, RuntimeError):  # a torch without mkldnn.data_ptr / _nbytes
        logger.debug("cannot read oneDNN's packed buffer", exc_info=True)
        return None
    if not matches:
        logger.debug("oneDNN packed a %s %s weight in another layout", tuple(weight.shape),
                     weight.dtype)  # fmt: skip
        return None
    return int(torch.ops.mkldnn.data_ptr(packed))
