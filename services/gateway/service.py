"""The Gateway servicer: a thin adapter from the wire request to the orchestrator.

`Generate` validates every field first (INVALID_ARGUMENT naming it), then streams what the
orchestrator yields; typed errors become status codes in `services.rpc.errors`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from services.gateway.orchestrator import Orchestrator
from services.gateway.validation import RequestLimits, validate_request
from services.rpc.errors import maps_errors
from services.rpc.kvrelay.v1 import gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Implements kvrelay.v1.Gateway."""

    def __init__(self, limits: RequestLimits, encode: Callable[[str], list[int]], orchestrator: Orchestrator) -> None:
        self.limits = limits
        self.encode = encode
        self.orchestrator = orchestrator

    @maps_errors
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        generation = validate_request(request, self.limits, self.encode)
        async for event in self.orchestrator.generate(generation):
            yield event
