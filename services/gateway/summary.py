"""The last event of a generation: what the client waited for and what the KV policy cost.

`TokenClock` times the stream as the client sees it (from the moment the gateway accepted
the request); `build_summary` combines it with the prefill worker's receipt and ledger and
the decode worker's summary (pure: protobuf in, protobuf out, at the RPC edge).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.rpc.kvrelay.v1 import common_pb2, decode_pb2, gateway_pb2, prefill_pb2


@dataclass
class TokenClock:
    """Arrival times of the tokens forwarded to the client (seconds, `clock`'s scale)."""

    clock: Callable[[], float] = time.perf_counter
    started: float = field(default=0.0)
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0

    def __post_init__(self) -> None:
        self.started = self.started or self.clock()

    def token(self) -> None:
        now = self.clock()
        self.first_token = self.first_token if self.first_token is not None else now
        self.last_token = now
        self.tokens += 1

    @property
    def ttft_ms(self) -> float:
        return 0.0 if self.first_token is None else 1000.0 * (self.first_token - self.started)

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first."""
        if self.tokens < 2 or self.first_token is None or self.last_token is None:
            return 0.0
        return 1000.0 * (self.last_token - self.first_token) / (self.tokens - 1)


@dataclass(frozen=True)
class Route:
    """Who served one attempt."""

    request_id: str
    manifest_sha256: str
    prompt_tokens: int
    prefill_worker: str
    decode_worker: str


def build_summary(
    route: Route,
    prefilled: prefill_pb2.PrefillResponse,
    decoded: decode_pb2.DecodeSummary,
    clock: TokenClock,
) -> gateway_pb2.GenerateSummary:
    """The GenerateSummary: timings from `clock`, the retained/omitted rows of the receipt,
    generations of the last published state, and the decode worker's ledger (bytes moved
    included), falling back to the prefill worker's when the decode worker sent none."""
    ledger = decoded.ledger if decoded.HasField("ledger") else prefilled.ledger
    generations = decoded.generations if decoded.HasField("generations") else prefilled.receipt.generations
    return gateway_pb2.GenerateSummary(
        request_id=route.request_id,
        ttft_ms=clock.ttft_ms,
        tpot_ms=clock.tpot_ms,
        prompt_tokens=route.prompt_tokens,
        output_tokens=clock.tokens,
        finish_reason=decoded.finish_reason or common_pb2.FINISH_REASON_UNSPECIFIED,
        manifest_sha256=route.manifest_sha256,
        generations=generations,
        retained_rows=prefilled.receipt.retained_rows,
        omitted_rows=prefilled.receipt.omitted_rows,
        recalled_rows=decoded.recalled_rows,
        bytes_moved=ledger.bytes_moved,
        ledger=ledger,
        fallbacks=list(decoded.fallbacks),
        prefill_worker=prefilled.prefill_worker or route.prefill_worker,
        decode_worker=route.decode_worker,
        retention=decoded.retention if decoded.HasField("retention") else None,
    )
