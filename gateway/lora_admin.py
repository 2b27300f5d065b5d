"""Run-time LoRA updates as both public APIs take them (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``; the gRPC API's ``LoadLoraAdapter`` and ``UnloadLoraAdapter``): the
fields checked, then ``LoraUpdates`` fans the call out to the nodes."""

from __future__ import annotations

from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.frontend import Frontend
from gateway.routing.lora_updates import LoraUpdates


async def load_adapter(frontend: Frontend, name: str, path: str) -> str:
    """Load ``path`` (as the nodes' hosts see it) as the model ``name`` on every node; vLLM's
    success text, or ``GatewayError`` naming the field."""
    updates = _updates(frontend)
    _check_name(name, frontend)
    if not path.strip():
        raise invalid("lora_path must not be blank", param="lora_path")
    return await updates.load(name, path)


async def unload_adapter(frontend: Frontend, name: str) -> str:
    """Unload adapter ``name`` from every node (its running requests finish with it)."""
    updates = _updates(frontend)
    _check_name(name, frontend)
    return await updates.unload(name)


def _updates(frontend: Frontend) -> LoraUpdates:
    if frontend.lora_updates is None:
        raise GatewayError(
            ErrorKind.FAILED_PRECONDITION,
            "run-time LoRA updates are off: start the gateway with --allow-runtime-lora-updating",
        )
    return frontend.lora_updates


def _check_name(name: str, frontend: Frontend) -> None:
    """A run-time adapter's name: non-blank, and not a name of the base model."""
    if not name.strip():
        raise invalid("lora_name must not be blank", param="lora_name")
    if name in frontend.served_model_names:
        raise invalid(f"lora_name {name!r} is a name of the base model", param="lora_name")
