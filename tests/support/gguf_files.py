"""Small GGUF files a test writes itself: the writer's closing steps, and a file whose SentencePiece
tokenizer has no scores to derive its merges from (which pdserve refuses)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


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
