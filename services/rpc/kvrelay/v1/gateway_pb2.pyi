from services.rpc.kvrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "manifest", "detokenize")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: _common_pb2.SamplingParams
    manifest: _common_pb2.ManifestSelector
    detokenize: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., manifest: _Optional[_Union[_common_pb2.ManifestSelector, _Mapping]] = ..., detokenize: _Optional[bool] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("token", "summary")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.TokenEvent
    summary: GenerateSummary
    def __init__(self, token: _Optional[_Union[_common_pb2.TokenEvent, _Mapping]] = ..., summary: _Optional[_Union[GenerateSummary, _Mapping]] = ...) -> None: ...

class GenerateSummary(_message.Message):
    __slots__ = ("request_id", "ttft_ms", "tpot_ms", "prompt_tokens", "output_tokens", "finish_reason", "manifest_sha256", "generations", "retained_rows", "omitted_rows", "recalled_rows", "bytes_moved", "ledger", "fallbacks", "trace_id", "prefill_worker", "decode_worker", "retention")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_ROWS_FIELD_NUMBER: _ClassVar[int]
    OMITTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    RECALLED_ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ttft_ms: float
    tpot_ms: float
    prompt_tokens: int
    output_tokens: int
    finish_reason: _common_pb2.FinishReason
    manifest_sha256: str
    generations: _common_pb2.Generations
    retained_rows: int
    omitted_rows: int
    recalled_rows: int
    bytes_moved: int
    ledger: _common_pb2.Ledger
    fallbacks: _containers.RepeatedScalarFieldContainer[str]
    trace_id: str
    prefill_worker: str
    decode_worker: str
    retention: _common_pb2.RetentionSummary
    def __init__(self, request_id: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., manifest_sha256: _Optional[str] = ..., generations: _Optional[_Union[_common_pb2.Generations, _Mapping]] = ..., retained_rows: _Optional[int] = ..., omitted_rows: _Optional[int] = ..., recalled_rows: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., ledger: _Optional[_Union[_common_pb2.Ledger, _Mapping]] = ..., fallbacks: _Optional[_Iterable[str]] = ..., trace_id: _Optional[str] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., retention: _Optional[_Union[_common_pb2.RetentionSummary, _Mapping]] = ...) -> None: ...
