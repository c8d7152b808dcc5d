from services.rpc.kvrelay.v1 import common_pb2 as _common_pb2
from services.rpc.kvrelay.v1 import decode_pb2 as _decode_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PageRef(_message.Message):
    __slots__ = ("layer", "kv_head", "page_index")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kv_head: int
    page_index: int
    def __init__(self, layer: _Optional[int] = ..., kv_head: _Optional[int] = ..., page_index: _Optional[int] = ...) -> None: ...

class RecallRequest(_message.Message):
    __slots__ = ("request_id", "request_generation", "parent_state_generation", "handoff_id", "pages", "trace_context", "rendezvous_address", "inline")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PARENT_STATE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_generation: int
    parent_state_generation: int
    handoff_id: str
    pages: _containers.RepeatedCompositeFieldContainer[PageRef]
    trace_context: _containers.ScalarMap[str, str]
    rendezvous_address: str
    inline: bool
    def __init__(self, request_id: _Optional[str] = ..., request_generation: _Optional[int] = ..., parent_state_generation: _Optional[int] = ..., handoff_id: _Optional[str] = ..., pages: _Optional[_Iterable[_Union[PageRef, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., rendezvous_address: _Optional[str] = ..., inline: _Optional[bool] = ...) -> None: ...

class RecalledPage(_message.Message):
    __slots__ = ("page", "positions", "k", "v", "dtype", "head_dim", "rows", "v_dtype")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    V_DTYPE_FIELD_NUMBER: _ClassVar[int]
    page: PageRef
    positions: _containers.RepeatedScalarFieldContainer[int]
    k: bytes
    v: bytes
    dtype: str
    head_dim: int
    rows: int
    v_dtype: str
    def __init__(self, page: _Optional[_Union[PageRef, _Mapping]] = ..., positions: _Optional[_Iterable[int]] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., dtype: _Optional[str] = ..., head_dim: _Optional[int] = ..., rows: _Optional[int] = ..., v_dtype: _Optional[str] = ...) -> None: ...

class RecallResponse(_message.Message):
    __slots__ = ("pages", "missing", "bytes", "transfer", "generations")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[RecalledPage]
    missing: _containers.RepeatedCompositeFieldContainer[PageRef]
    bytes: int
    transfer: _decode_pb2.TransferDescriptor
    generations: _common_pb2.Generations
    def __init__(self, pages: _Optional[_Iterable[_Union[RecalledPage, _Mapping]]] = ..., missing: _Optional[_Iterable[_Union[PageRef, _Mapping]]] = ..., bytes: _Optional[int] = ..., transfer: _Optional[_Union[_decode_pb2.TransferDescriptor, _Mapping]] = ..., generations: _Optional[_Union[_common_pb2.Generations, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("request_id", "request_generation", "handoff_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_generation: int
    handoff_id: str
    def __init__(self, request_id: _Optional[str] = ..., request_generation: _Optional[int] = ..., handoff_id: _Optional[str] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("entries", "lease_ms")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    entries: int
    lease_ms: int
    def __init__(self, entries: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "request_generation", "handoff_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_generation: int
    handoff_id: str
    def __init__(self, request_id: _Optional[str] = ..., request_generation: _Optional[int] = ..., handoff_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...
