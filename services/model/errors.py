"""Typed errors of the model runtime. Each names the file, field or architecture at fault so
that a worker can report it verbatim (gRPC maps them to status codes once, at the edge)."""

from __future__ import annotations

from pathlib import Path


class ModelError(Exception):
    """Base class of every error raised by `services.model`."""


class MissingCheckpointFile(ModelError):
    """A file the checkpoint needs is absent from the checkpoint directory."""

    def __init__(self, path: Path | str, why: str = "") -> None:
        self.path = Path(path)
        detail = f" ({why})" if why else ""
        super().__init__(f"missing checkpoint file: {self.path}{detail}")


class UnsupportedArchitecture(ModelError):
    """config.json names an architecture or model_type this runtime does not implement."""

    def __init__(self, name: str, supported: tuple[str, ...]) -> None:
        self.name = name
        self.supported = supported
        super().__init__(
            f"unsupported architecture {name!r}; supported: {', '.join(supported)}"
        )


class InvalidModelConfig(ModelError):
    """A config.json / generation_config.json field is missing, malformed or unsupported."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"invalid model config field {field!r}: {reason}")


class CheckpointMismatch(ModelError):
    """The weights do not match the architecture declared by config.json."""

    def __init__(self, tensor: str, reason: str) -> None:
        self.tensor = tensor
        self.reason = reason
        super().__init__(f"checkpoint tensor {tensor!r}: {reason}")


class InvalidModelInput(ModelError):
    """A runtime call received an argument that violates the model's tensor contract."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"invalid {field}: {reason}")


class NonFiniteLogits(ModelError):
    """Logits rows that no token can be sampled from: a NaN or +inf, or no finite entry.
    `rows` are their indices in the batch; every other row of it is sound."""

    def __init__(self, rows: tuple[int, ...]) -> None:
        self.rows = rows
        shown = ", ".join(str(row) for row in rows[:8]) + (", ..." if len(rows) > 8 else "")
        super().__init__(f"logits rows [{shown}] are not finite (NaN, +inf, or no finite entry)")


class KVPoolExhausted(ModelError):
    """The KV page pool cannot give `needed` more pages: its byte budget (`field`, e.g. the
    decode worker's kv_budget_bytes) is reserved or in use. Nothing was allocated past it.
    `request_id` names the request the pages were for ("" when none)."""

    def __init__(self, field: str, reason: str, request_id: str = "") -> None:
        self.field = field
        self.reason = reason
        self.request_id = request_id
        super().__init__(f"{field} exhausted: {reason}")
