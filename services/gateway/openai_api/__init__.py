"""The gateway's OpenAI-compatible HTTP front (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`): FastAPI + uvicorn in the gateway process, over the same prompt
validation and orchestrator as the gRPC `Generate` (see `app`). Imported only by the gateway
server, so `services.gateway` stays light for CLI clients."""
