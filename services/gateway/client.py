"""A small synchronous client of the Gateway API, for the CLI (`kvrelay generate`, `kvrelay
demo`), the end-to-end benchmark and tests.

    request = generate_request("what is the code of ada ? answer :", policy="snapkv", max_tokens=4)
    with GatewayClient("127.0.0.1:50051") as client:
        for event in client.stream(request): ...      # token events, then the summary
        result = client.generate(request)             # or collect everything

    chat = chat_messages([("system", "Answer in one word."), ("user", "Capital of France?")])
    result = client.generate(generate_request(chat, max_tokens=16))   # the checkpoint's template

`ChatHistory` keeps the turns of an interactive conversation (`kvrelay chat`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from services.security.roles import Role
from services.security.transport import TransportSecurity


def chat_messages(turns: Iterable[tuple[str, str]]) -> gateway_pb2.ChatMessages:
    """A chat prompt from (role, content) pairs, oldest first; the gateway validates them."""
    return gateway_pb2.ChatMessages(
        messages=[gateway_pb2.ChatMessage(role=role, content=content) for role, content in turns]
    )


def generate_request(
    prompt: str | Sequence[int] | gateway_pb2.ChatMessages,
    *,
    policy: str | None = None,
    manifest_sha256: str | None = None,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
    detokenize: bool = True,
    request_id: str = "",
) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest from plain values: text, token ids or chat messages, a policy by name
    (latest generation) or by sha256, and sampling (omitted entirely when every value is
    default, so the gateway's default max_tokens applies)."""
    request = gateway_pb2.GenerateRequest(request_id=request_id, detokenize=detokenize)
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, gateway_pb2.ChatMessages):
        request.chat.SetInParent()  # an empty conversation is still a chat prompt (and invalid)
        request.chat.MergeFrom(prompt)
    else:
        request.token_ids.ids.extend(prompt)
    if manifest_sha256:
        request.manifest.sha256 = manifest_sha256
    elif policy:
        request.manifest.by_name.name = policy
    if max_tokens is not None or temperature or top_k or top_p or seed or stop_token_ids:
        request.sampling.CopyFrom(common_pb2.SamplingParams(
            max_tokens=max_tokens or 0, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop_token_ids=list(stop_token_ids),
        ))
    return request


@dataclass
class ChatHistory:
    """The turns of one conversation: an optional system message, then user/assistant pairs.
    `prompt(user)` is the chat to send for a new user turn; `record` keeps the finished turn."""

    system: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)

    def prompt(self, user: str) -> gateway_pb2.ChatMessages:
        system = [("system", self.system)] if self.system else []
        return chat_messages([*system, *self.turns, ("user", user)])

    def record(self, user: str, reply: str) -> None:
        """Keep a finished turn. An empty reply is not kept (the gateway refuses empty
        messages); the user's turn is, so the next turn still sees what was asked."""
        self.turns.append(("user", user))
        if reply.strip():
            self.turns.append(("assistant", reply))

    def reset(self) -> None:
        self.turns.clear()


@dataclass(frozen=True)
class Generation:
    """Everything one Generate call returned."""

    token_ids: tuple[int, ...]
    text: str
    summary: gateway_pb2.GenerateSummary


class GatewayClient:
    """Blocking client; `timeout_s` bounds each whole Generate call. `security` says how to
    reach the gateway (default: plaintext, loopback only); `api_key` is sent with every call
    as `authorization: Bearer` (the gateway asks for one when it has --auth-tokens)."""

    def __init__(self, address: str, timeout_s: float = 300.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *,
                 security: TransportSecurity | None = None, api_key: str = "") -> None:
        self.address = address
        self.timeout_s = timeout_s
        security = security or TransportSecurity.local_plaintext()
        self._channel = security.channel(address, Role.GATEWAY, channel_options(max_message_bytes))
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def stream(self, request: gateway_pb2.GenerateRequest) -> Iterator[gateway_pb2.GenerateEvent]:
        """Events as they arrive. Raises grpc.RpcError on a failed call (closing the
        iterator early cancels the call)."""
        call = self._stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def generate(self, request: gateway_pb2.GenerateRequest) -> Generation:
        ids: list[int] = []
        text: list[str] = []
        for event in self.stream(request):
            if event.HasField("summary"):
                return Generation(tuple(ids), "".join(text), event.summary)
            ids.append(event.token.token_id)
            text.append(event.token.text)
        raise RuntimeError(f"gateway {self.address} ended the stream without a summary")
