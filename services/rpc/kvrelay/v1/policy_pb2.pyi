from services.rpc.kvrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterManifestRequest(_message.Message):
    __slots__ = ("manifest_json",)
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    manifest_json: bytes
    def __init__(self, manifest_json: _Optional[bytes] = ...) -> None: ...

class RegisterManifestResponse(_message.Message):
    __slots__ = ("ref", "created")
    REF_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.ManifestRef
    created: bool
    def __init__(self, ref: _Optional[_Union[_common_pb2.ManifestRef, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.Manifest
    def __init__(self, manifest: _Optional[_Union[_common_pb2.Manifest, _Mapping]] = ...) -> None: ...

class ListManifestsRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListManifestsResponse(_message.Message):
    __slots__ = ("manifests",)
    MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    manifests: _containers.RepeatedCompositeFieldContainer[_common_pb2.ManifestRef]
    def __init__(self, manifests: _Optional[_Iterable[_Union[_common_pb2.ManifestRef, _Mapping]]] = ...) -> None: ...

class BeginRequestRequest(_message.Message):
    __slots__ = ("request_id", "lease_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_ms: int
    def __init__(self, request_id: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class BeginRequestResponse(_message.Message):
    __slots__ = ("fence",)
    FENCE_FIELD_NUMBER: _ClassVar[int]
    fence: _common_pb2.Fence
    def __init__(self, fence: _Optional[_Union[_common_pb2.Fence, _Mapping]] = ...) -> None: ...

class PublishStateRequest(_message.Message):
    __slots__ = ("request_id", "request_generation", "parent_state_generation", "state_generation", "cache_generation", "receipt_digest", "manifest_sha256", "phase", "prefill_worker", "decode_worker", "lease_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PARENT_STATE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_generation: int
    parent_state_generation: int
    state_generation: int
    cache_generation: int
    receipt_digest: str
    manifest_sha256: str
    phase: _common_pb2.Phase
    prefill_worker: str
    decode_worker: str
    lease_ms: int
    def __init__(self, request_id: _Optional[str] = ..., request_generation: _Optional[int] = ..., parent_state_generation: _Optional[int] = ..., state_generation: _Optional[int] = ..., cache_generation: _Optional[int] = ..., receipt_digest: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., phase: _Optional[_Union[_common_pb2.Phase, str]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class PublishStateResponse(_message.Message):
    __slots__ = ("fence", "already_published")
    FENCE_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    fence: _common_pb2.Fence
    already_published: bool
    def __init__(self, fence: _Optional[_Union[_common_pb2.Fence, _Mapping]] = ..., already_published: _Optional[bool] = ...) -> None: ...

class GetFenceRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GetFenceResponse(_message.Message):
    __slots__ = ("fence",)
    FENCE_FIELD_NUMBER: _ClassVar[int]
    fence: _common_pb2.Fence
    def __init__(self, fence: _Optional[_Union[_common_pb2.Fence, _Mapping]] = ...) -> None: ...

class EndRequestRequest(_message.Message):
    __slots__ = ("request_id", "request_generation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_generation: int
    def __init__(self, request_id: _Optional[str] = ..., request_generation: _Optional[int] = ...) -> None: ...

class EndRequestResponse(_message.Message):
    __slots__ = ("fence",)
    FENCE_FIELD_NUMBER: _ClassVar[int]
    fence: _common_pb2.Fence
    def __init__(self, fence: _Optional[_Union[_common_pb2.Fence, _Mapping]] = ...) -> None: ...

class SessionCall(_message.Message):
    __slots__ = ("call_id", "timeout_ms", "trace_context", "begin_request", "publish_state", "get_fence", "end_request")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    BEGIN_REQUEST_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_STATE_FIELD_NUMBER: _ClassVar[int]
    GET_FENCE_FIELD_NUMBER: _ClassVar[int]
    END_REQUEST_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    timeout_ms: int
    trace_context: _containers.ScalarMap[str, str]
    begin_request: BeginRequestRequest
    publish_state: PublishStateRequest
    get_fence: GetFenceRequest
    end_request: EndRequestRequest
    def __init__(self, call_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., begin_request: _Optional[_Union[BeginRequestRequest, _Mapping]] = ..., publish_state: _Optional[_Union[PublishStateRequest, _Mapping]] = ..., get_fence: _Optional[_Union[GetFenceRequest, _Mapping]] = ..., end_request: _Optional[_Union[EndRequestRequest, _Mapping]] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("call_id", "error", "begin_request", "publish_state", "get_fence", "end_request")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BEGIN_REQUEST_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_STATE_FIELD_NUMBER: _ClassVar[int]
    GET_FENCE_FIELD_NUMBER: _ClassVar[int]
    END_REQUEST_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    error: SessionError
    begin_request: BeginRequestResponse
    publish_state: PublishStateResponse
    get_fence: GetFenceResponse
    end_request: EndRequestResponse
    def __init__(self, call_id: _Optional[int] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ..., begin_request: _Optional[_Union[BeginRequestResponse, _Mapping]] = ..., publish_state: _Optional[_Union[PublishStateResponse, _Mapping]] = ..., get_fence: _Optional[_Union[GetFenceResponse, _Mapping]] = ..., end_request: _Optional[_Union[EndRequestResponse, _Mapping]] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("authorization",)
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    authorization: str
    def __init__(self, authorization: _Optional[str] = ...) -> None: ...

class SessionWelcome(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: SessionError
    def __init__(self, error: _Optional[_Union[SessionError, _Mapping]] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "detail")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    code: int
    detail: _common_pb2.ErrorDetail
    def __init__(self, code: _Optional[int] = ..., detail: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ...) -> None: ...
