"""Small GGUF files a test writes itself: the writer's closing steps, and a file whose SentencePiece
tokenizer has no scores to derive its merges from (which pdserve refuses); and where the tiny
conversions' checkpoints are, with the reference their quantized weights round-trip to."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file


def close_gguf(writer: gguf.GGUFWriter) -> None:
    """Writes the header, the metadata and the tensors added so far, then closes the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def sentencepiece_gguf(path: Path) -> Path:
    """A three-token Llama vocabulary in llama.cpp's SentencePiece form (tokenizer model
    ``llama``) without scores or merges, with an embedding and nothing else."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 4), dtype=np.float32))
    close_gguf(writer)
    return path


def gguf_source(gguf_path: Path) -> Path:
    """The Hugging Face checkpoint a ``tiny_gguf_factory`` file was converted from."""
    return gguf_path.parent / "hf"


def round_trip_dir(model_dir: Path, qtype: str, out: Path) -> Path:
    """A copy of ``model_dir`` whose 2-D weights went through ``qtype`` and back (the weights a
    GGUF of that type holds, in Hugging Face layout)."""
    shutil.copytree(model_dir, out)
    tensors = load_file(model_dir / "model.safetensors")
    for name, tensor in tensors.items():
        if tensor.ndim == 2:
            data = tensor.float().numpy()
            if qtype == "F16":
                back = data.astype(np.float16).astype(np.float32)
            else:
                quant = gguf.GGMLQuantizationType[qtype]
                back = gguf.quants.dequantize(gguf.quants.quantize(data, quant), quant)
            tensors[name] = torch.from_numpy(back.reshape(data.shape).copy())
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
