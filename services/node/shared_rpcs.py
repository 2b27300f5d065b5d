"""The RPCs every role answers the same way, over its config, engine and server: ``GetLoad``,
``LoadLoraAdapter``, ``UnloadLoraAdapter`` and ``Embed``. Each role's servicer inherits them
(before its generated base class, whose defaults answer UNIMPLEMENTED)."""

from __future__ import annotations

import grpc

from pdserve.v1 import common_pb2
from services.async_engine import AsyncEngine
from services.node.config import NodeConfig
from services.node.embed import EmbedContext, embed
from services.node.lora_updates import (
    LoadContext,
    UnloadContext,
    load_lora_adapter,
    unload_lora_adapter,
)
from services.node.runtime import NodeServerRef, load_report


class SharedNodeRpcs:
    config: NodeConfig
    engine: AsyncEngine
    server: NodeServerRef

    async def GetLoad(
        self,
        request: common_pb2.GetLoadRequest,
        context: grpc.aio.ServicerContext[common_pb2.GetLoadRequest, common_pb2.LoadReport],
    ) -> common_pb2.LoadReport:
        return await load_report(self.config, self.engine, self.server, context)

    async def LoadLoraAdapter(
        self, request: common_pb2.LoadLoraAdapterRequest, context: LoadContext
    ) -> common_pb2.LoadLoraAdapterResponse:
        return await load_lora_adapter(self.engine, request, context)

    async def UnloadLoraAdapter(
        self, request: common_pb2.UnloadLoraAdapterRequest, context: UnloadContext
    ) -> common_pb2.UnloadLoraAdapterResponse:
        return await unload_lora_adapter(self.engine, request, context)

    async def Embed(
        self, request: common_pb2.EmbedRequest, context: EmbedContext
    ) -> common_pb2.EmbedResult:
        return await embed(self.engine, self.server, request, context)
