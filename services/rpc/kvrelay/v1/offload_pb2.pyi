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
    __slots__ = ("request_id", "request_generation", "parent_state_generation", "handoff_id", "pages", "trace_context")
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
    request_id: str
    request_generation: int
    parent_state_generation: int
    handoff_id: str
    pages: _containers.RepeatedCompositeFieldContainer[PageRef]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., request_generation: _Optional[int] = ..., parent_state_generation: _Optional[int] = ..., handoff_id: _Optional[str] = ..., pages: _Optional[_Iterable[_Union[PageRef, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RecalledPage(_message.Message):
    __slots__ = ("page", "positions", "k", "v", "dtype", "head_dim")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    page: PageRef
    positions: _containers.RepeatedScalarFieldContainer[int]
    k: bytes
    v: bytes
    dtype: str
    head_dim: int
    def __init__(self, page: _Optional[_Union[PageRef, _Mapping]] = ..., positions: _Optional[_Iterable[int]] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., dtype: _Optional[str] = ..., head_dim: _Optional[int] = ...) -> None: ...

class RecallResponse(_message.Message):
    __slots__ = ("pages", "missing", "bytes")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[RecalledPage]
    missing: _containers.RepeatedCompositeFieldContainer[PageRef]
    bytes: int
    def __init__(self, pages: _Optional[_Iterable[_Union[RecalledPage, _Mapping]]] = ..., missing: _Optional[_Iterable[_Union[PageRef, _Mapping]]] = ..., bytes: _Optional[int] = ...) -> None: ...
