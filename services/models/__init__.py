"""Llama-family model code (Llama, Mistral, Qwen2, Qwen3), the safetensors loader, and the
offline tiny-checkpoint builder (``python -m services.models.tiny``)."""
