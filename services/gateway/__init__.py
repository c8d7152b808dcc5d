"""The client-facing gateway: validates `Generate` requests, begins them in the policy
service, picks a healthy prefill and decode worker (least outstanding work), orchestrates
prefill -> transfer -> decode, retries a worker that fails before the first token, and
streams token events and a summary back.

`services.gateway.server` (GatewayServer, serve) loads the model runtime's config code and
with it torch; it is not imported here, so `services.gateway.client` stays light for CLIs.
"""

from services.gateway.config import GatewayConfig
from services.gateway.discovery import DiscoveryConfig, WorkerSource, pick
from services.gateway.validation import GenerationInput, RequestLimits, validate_request

__all__ = [
    "DiscoveryConfig",
    "GatewayConfig",
    "GenerationInput",
    "RequestLimits",
    "WorkerSource",
    "pick",
    "validate_request",
]
