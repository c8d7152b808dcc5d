from services.rpc.kvrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferDescriptor(_message.Message):
    __slots__ = ("transfer_id", "request_id", "receipt", "tensors", "rendezvous_address", "source_worker", "first_token_id", "sampling", "ledger", "offload_handoff_id", "offload_address", "prompt_tokens", "trace_context", "deadline_unix_ms", "recoverability", "page_size", "offload_lease_ms", "offload_degraded", "rendezvous_secret")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RECOVERABILITY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_SECRET_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    receipt: _common_pb2.Receipt
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    rendezvous_address: str
    source_worker: str
    first_token_id: int
    sampling: _common_pb2.SamplingParams
    ledger: _common_pb2.Ledger
    offload_handoff_id: str
    offload_address: str
    prompt_tokens: int
    trace_context: _containers.ScalarMap[str, str]
    deadline_unix_ms: int
    recoverability: str
    page_size: int
    offload_lease_ms: int
    offload_degraded: str
    rendezvous_secret: str
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., receipt: _Optional[_Union[_common_pb2.Receipt, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ..., rendezvous_address: _Optional[str] = ..., source_worker: _Optional[str] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., ledger: _Optional[_Union[_common_pb2.Ledger, _Mapping]] = ..., offload_handoff_id: _Optional[str] = ..., offload_address: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., deadline_unix_ms: _Optional[int] = ..., recoverability: _Optional[str] = ..., page_size: _Optional[int] = ..., offload_lease_ms: _Optional[int] = ..., offload_degraded: _Optional[str] = ..., rendezvous_secret: _Optional[str] = ...) -> None: ...

class GetTransferEndpointRequest(_message.Message):
    __slots__ = ("source_worker",)
    SOURCE_WORKER_FIELD_NUMBER: _ClassVar[int]
    source_worker: str
    def __init__(self, source_worker: _Optional[str] = ...) -> None: ...

class TransferEndpoint(_message.Message):
    __slots__ = ("rendezvous_address", "decode_worker", "backends")
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    rendezvous_address: str
    decode_worker: str
    backends: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rendezvous_address: _Optional[str] = ..., decode_worker: _Optional[str] = ..., backends: _Optional[_Iterable[str]] = ...) -> None: ...

class AcceptTransferRequest(_message.Message):
    __slots__ = ("descriptor",)
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    descriptor: TransferDescriptor
    def __init__(self, descriptor: _Optional[_Union[TransferDescriptor, _Mapping]] = ...) -> None: ...

class AcceptTransferResponse(_message.Message):
    __slots__ = ("transfer_id", "accepted", "sender_rank", "receiver_rank", "reserved_bytes", "decode_worker")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SENDER_RANK_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_RANK_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    accepted: bool
    sender_rank: int
    receiver_rank: int
    reserved_bytes: int
    decode_worker: str
    def __init__(self, transfer_id: _Optional[str] = ..., accepted: _Optional[bool] = ..., sender_rank: _Optional[int] = ..., receiver_rank: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., decode_worker: _Optional[str] = ...) -> None: ...

class StreamTokensRequest(_message.Message):
    __slots__ = ("request_id", "request_generation", "transfer_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_generation: int
    transfer_id: str
    def __init__(self, request_id: _Optional[str] = ..., request_generation: _Optional[int] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("token", "summary")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.TokenEvent
    summary: DecodeSummary
    def __init__(self, token: _Optional[_Union[_common_pb2.TokenEvent, _Mapping]] = ..., summary: _Optional[_Union[DecodeSummary, _Mapping]] = ...) -> None: ...

class DecodeSummary(_message.Message):
    __slots__ = ("output_tokens", "tpot_ms", "finish_reason", "generations", "ledger", "recalled_rows", "recall_count", "fallbacks", "verified_receipt_digest", "retained_rows", "retention")
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    RECALLED_ROWS_FIELD_NUMBER: _ClassVar[int]
    RECALL_COUNT_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_RECEIPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RETAINED_ROWS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    output_tokens: int
    tpot_ms: float
    finish_reason: _common_pb2.FinishReason
    generations: _common_pb2.Generations
    ledger: _common_pb2.Ledger
    recalled_rows: int
    recall_count: int
    fallbacks: _containers.RepeatedScalarFieldContainer[str]
    verified_receipt_digest: str
    retained_rows: int
    retention: _common_pb2.RetentionSummary
    def __init__(self, output_tokens: _Optional[int] = ..., tpot_ms: _Optional[float] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., generations: _Optional[_Union[_common_pb2.Generations, _Mapping]] = ..., ledger: _Optional[_Union[_common_pb2.Ledger, _Mapping]] = ..., recalled_rows: _Optional[int] = ..., recall_count: _Optional[int] = ..., fallbacks: _Optional[_Iterable[str]] = ..., verified_receipt_digest: _Optional[str] = ..., retained_rows: _Optional[int] = ..., retention: _Optional[_Union[_common_pb2.RetentionSummary, _Mapping]] = ...) -> None: ...
