from services.rpc.kvrelay.v1 import common_pb2 as _common_pb2
from services.rpc.kvrelay.v1 import decode_pb2 as _decode_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "request_generation", "prompt_token_ids", "sampling", "manifest_sha256", "decode_worker_address", "decode_worker_id", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_generation: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    manifest_sha256: str
    decode_worker_address: str
    decode_worker_id: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., request_generation: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., manifest_sha256: _Optional[str] = ..., decode_worker_address: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("receipt", "transfer", "ledger", "prefill_ms", "prefill_worker")
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    receipt: _common_pb2.Receipt
    transfer: _decode_pb2.TransferDescriptor
    ledger: _common_pb2.Ledger
    prefill_ms: float
    prefill_worker: str
    def __init__(self, receipt: _Optional[_Union[_common_pb2.Receipt, _Mapping]] = ..., transfer: _Optional[_Union[_decode_pb2.TransferDescriptor, _Mapping]] = ..., ledger: _Optional[_Union[_common_pb2.Ledger, _Mapping]] = ..., prefill_ms: _Optional[float] = ..., prefill_worker: _Optional[str] = ...) -> None: ...
