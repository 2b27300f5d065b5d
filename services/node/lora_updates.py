"""LoadLoraAdapter and UnloadLoraAdapter for every role: a node's LoRA adapters changed while it
serves (the gateway's ``--allow-runtime-lora-updating`` fans these calls out to every node).

Both run on the engine thread between two steps (``AsyncEngine.call``): the adapter's files are
read and its weights placed there, as at start-up, so a large adapter holds up the node's steps
while it loads. An unload takes effect for new requests at once (the adapter leaves the load
report, so the gateway stops routing to it); requests already running with it finish with it,
and the engine drops it when the last one ends (``EngineCore.retire_lora``). A prefill node
also keeps it for the call's ``grace_ms`` for the requests reserved on their decode node before
the unload, whose prompts have not reached it yet.
"""

from __future__ import annotations

import grpc

from pdserve.v1 import common_pb2
from services.async_engine import AsyncEngine, EngineDeadError
from services.engine import LoraCapacityError
from services.models.lora import LoraAdapterError
from services.types.lora_request import LoRARequest

LoadContext = grpc.aio.ServicerContext[
    common_pb2.LoadLoraAdapterRequest, common_pb2.LoadLoraAdapterResponse
]
UnloadContext = grpc.aio.ServicerContext[
    common_pb2.UnloadLoraAdapterRequest, common_pb2.UnloadLoraAdapterResponse
]

LORA_OFF = "LoRA is off on this node: start it with --enable-lora (or --lora-modules)"


async def load_lora_adapter(
    engine: AsyncEngine, request: common_pb2.LoadLoraAdapterRequest, context: LoadContext
) -> common_pb2.LoadLoraAdapterResponse:
    if not request.lora_name.strip():
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name: must not be blank")
    if not request.lora_path.strip():
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: must not be blank")
    if engine.engine.config.lora is None:  # a frozen config: read from any thread
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, LORA_OFF)
    lora_request = LoRARequest(request.lora_name, 1, request.lora_path)
    try:
        lora_request.path  # noqa: B018  resolved here: "~nobody/x" raises RuntimeError
    except (RuntimeError, OSError) as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: {exc}")
    try:
        loaded = await engine.call(lambda core: core.add_lora(lora_request))
    except LoraAdapterError as exc:  # the files: what the engine cannot apply, or read
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: {exc}")
    except OSError as exc:  # a file the node may not read (permissions, I/O)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: cannot read: {exc}")
    except LoraCapacityError as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"max_loras: {exc}")
    except ValueError as exc:  # the name is loaded from other files
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"lora_name: {exc}")
    except EngineDeadError as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    return common_pb2.LoadLoraAdapterResponse(loaded=loaded)


async def unload_lora_adapter(
    engine: AsyncEngine, request: common_pb2.UnloadLoraAdapterRequest, context: UnloadContext
) -> common_pb2.UnloadLoraAdapterResponse:
    name = request.lora_name
    if not name.strip():
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name: must not be blank")
    if engine.engine.config.lora is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, LORA_OFF)
    try:
        grace_s = request.grace_ms / 1000
        num_requests = await engine.call(lambda core: core.retire_lora(name, grace_s))
    except EngineDeadError as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    if num_requests is None:
        await context.abort(
            grpc.StatusCode.NOT_FOUND, f"lora_name: no LoRA adapter {name!r} is loaded"
        )
    return common_pb2.UnloadLoraAdapterResponse(num_requests=num_requests)
