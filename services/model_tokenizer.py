"""The model's tokenizer as the ``tokenizers`` library reads it, for the engine's own uses.

A Hugging Face directory holds it as ``tokenizer.json``; a GGUF checkpoint has none, and
``services.gguf_tokenizer`` builds the same object from its metadata. The gateway encodes prompts
with this very tokenizer (``gateway.text.tokenizer``), so that guided decoding's grammar
(``services.engine.structured_output``) and the offline ``LLM``'s text prompts and outputs use the
model's token ids. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HfTokenizer

from services.gguf_tokenizer import gguf_tokenizer_parts
from services.models.gguf_file import find_gguf, open_gguf


def tokenizer_json(model_path: Path, purpose: str) -> str:
    """The ``tokenizer.json`` text of the model at ``model_path``; ``ValueError`` saying what is
    missing, and that ``purpose`` needs it, when it has no tokenizer pdserve can read."""
    gguf_path = find_gguf(model_path)
    if gguf_path is not None:
        try:
            parts = gguf_tokenizer_parts(open_gguf(gguf_path))
        except ValueError as exc:
            raise ValueError(f"{purpose} needs the model's tokenizer: {exc}") from None
        return parts.backend.to_str()
    tokenizer_file = Path(model_path) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(
            f"{purpose} needs the model's tokenizer ({tokenizer_file} not found, and "
            f"{model_path} is not a GGUF checkpoint)"
        )
    return tokenizer_file.read_text(encoding="utf-8")


def load_tokenizer(model_path: Path, purpose: str) -> HfTokenizer:
    """The model's tokenizer (``tokenizer_json``), which never cuts or pads: a prompt's length
    is checked against the limits instead."""
    backend = HfTokenizer.from_str(tokenizer_json(model_path, purpose))
    backend.no_truncation()
    backend.no_padding()
    return backend
