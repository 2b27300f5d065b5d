"""Paged decode attention as a C++ CPU kernel that reads K/V straight out of the cache blocks.

Why: the torch path's decode (``TorchPagedAttention._decode``) copies every request's blocks
into a padded ``[num_decodes, max_len, ...]`` tensor with ``index_select`` and runs masked SDPA
over the copy. The kernel (``csrc/paged_attention.cpp``) walks each block table in place,
widens every K/V row once for its whole GQA group, accumulates in fp32 and splits the batch over
torch's OpenMP threads. ``benchmarks/attention_kernels.py`` (bf16, 12 query / 4 KV heads x 64,
block 16; 2-core AMD EPYC with AVX-512, 2 threads; ms per layer call, best of several runs on a
shared machine, so torch's figures vary by up to 2x):

    num_seqs x context     1 x 256    16 x 512    64 x 320    64 x 1024
    torch                  0.06       1.6-4.9     3.9-6.1     32-44
    native                 0.012      0.19-0.29   0.71-0.85   3.8-4.4

End to end on the 12-layer small model (64 requests, 256-token prompts, bf16), a decode step
takes ~45 ms instead of ~88 ms. In float32 the greedy tokens are those of the torch path.

Prefill chunks stay on the torch path: their attention is matmul-shaped work that SDPA already
does well (a native prefill kernel was not attempted).

The extension is compiled on first use (``torch.utils.cpp_extension.load``, ~10 s, most of it
``torch/library.h``), then cached under ``TORCH_EXTENSIONS_DIR`` or torch's default directory;
concurrent first builds from several processes wait on torch's lock file. ``native_kernel_error``
reports why the kernel is unavailable instead of raising, so ``make_attention_backend("auto",
...)`` can fall back to the torch path.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch

from services.models.attention import AttentionMetadata, TorchPagedAttention
from services.models.cpu_features import cpu_tag

logger = logging.getLogger(__name__)

_EXTENSION_BASE_NAME = "pdserve_paged_attention"
_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"

_lock = threading.Lock()
_build_attempted = False
_build_error: str | None = None


def native_kernel_error() -> str | None:
    """Builds and loads the kernel once per process; None if it is usable, else a one-line reason.

    Never raises: a missing compiler or a failed build is a reason, not an exception.
    """
    global _build_attempted, _build_error
    with _lock:
        if not _build_attempted:
            _build_error = _build_and_load()
            _build_attempted = True
        return _build_error


def _build_and_load() -> str | None:
    start = time.perf_counter()
    # Named after the CPU: the build uses -march=native (see cpu_features.cpu_tag).
    name = f"{_EXTENSION_BASE_NAME}_{cpu_tag()}"
    try:
        from torch.utils.cpp_extension import load

        # is_python_module=False: the .so registers torch.ops.pdserve.* (TORCH_LIBRARY), no
        # pybind11, which keeps the compile short.
        load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # compiler missing, build error, load error: all mean "fall back"
        logger.debug("building %s failed", name, exc_info=True)
        return _one_line(exc)
    elapsed = time.perf_counter() - start
    logger.info("native paged attention built or loaded in %.1f s", elapsed)
    return None


def _one_line(exc: BaseException, max_part: int = 200) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # A failed build's message is "Error building extension 'name': <the whole ninja log>"; keep
    # its head and the log's first line that names the cause.
    head = lines[0].split(": [", 1)[0] if lines else "no message"
    parts = [f"{type(exc).__name__}: {head}"]
    causes = ("error:", "not found", "No such file")
    parts += [line for line in lines[1:] if any(cause in line for cause in causes)][:1]
    return " | ".join(part if len(part) <= max_part else part[:max_part] + "..." for part in parts)


class NativePagedAttention(TorchPagedAttention):
    """``TorchPagedAttention`` with decodes on the native kernel; prefill chunks unchanged."""

    def __init__(self, block_size: int, scale: float) -> None:
        super().__init__(block_size, scale)
        error = native_kernel_error()
        if error is not None:
            raise RuntimeError(f"native paged attention is unavailable: {error}")

    def _decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        # query, output: [num_decodes, num_heads, head_dim]
        query = query.contiguous()
        output = torch.empty_like(query)
        torch.ops.pdserve.paged_decode_attention(
            output,
            query,
            key_cache,
            value_cache,
            metadata.decode_block_tables,
            metadata.decode_seq_lens,
            self.scale,
        )
        return output
