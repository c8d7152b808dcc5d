from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_BEGUN: _ClassVar[Phase]
    PHASE_PREFILLED: _ClassVar[Phase]
    PHASE_DECODING: _ClassVar[Phase]
    PHASE_RECALLED: _ClassVar[Phase]
    PHASE_ENDED: _ClassVar[Phase]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_MANIFEST_INVALID: _ClassVar[ErrorReason]
    ERROR_REASON_REQUEST_INVALID: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_STALE_GENERATION: _ClassVar[ErrorReason]
    ERROR_REASON_MANIFEST_CONFLICT: _ClassVar[ErrorReason]
    ERROR_REASON_REQUEST_ENDED: _ClassVar[ErrorReason]
    ERROR_REASON_BACKEND_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSFER_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_RECALL_TIMEOUT: _ClassVar[ErrorReason]
    ERROR_REASON_CAPACITY: _ClassVar[ErrorReason]
    ERROR_REASON_UNAUTHENTICATED: _ClassVar[ErrorReason]
    ERROR_REASON_PERMISSION_DENIED: _ClassVar[ErrorReason]
PHASE_UNSPECIFIED: Phase
PHASE_BEGUN: Phase
PHASE_PREFILLED: Phase
PHASE_DECODING: Phase
PHASE_RECALLED: Phase
PHASE_ENDED: Phase
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_CANCELLED: FinishReason
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_MANIFEST_INVALID: ErrorReason
ERROR_REASON_REQUEST_INVALID: ErrorReason
ERROR_REASON_NOT_FOUND: ErrorReason
ERROR_REASON_STALE_GENERATION: ErrorReason
ERROR_REASON_MANIFEST_CONFLICT: ErrorReason
ERROR_REASON_REQUEST_ENDED: ErrorReason
ERROR_REASON_BACKEND_UNAVAILABLE: ErrorReason
ERROR_REASON_TRANSFER_FAILED: ErrorReason
ERROR_REASON_RECALL_TIMEOUT: ErrorReason
ERROR_REASON_CAPACITY: ErrorReason
ERROR_REASON_UNAUTHENTICATED: ErrorReason
ERROR_REASON_PERMISSION_DENIED: ErrorReason

class ManifestRef(_message.Message):
    __slots__ = ("sha256", "name", "policy_generation")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_GENERATION_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    name: str
    policy_generation: int
    def __init__(self, sha256: _Optional[str] = ..., name: _Optional[str] = ..., policy_generation: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("ref", "canonical_json")
    REF_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_JSON_FIELD_NUMBER: _ClassVar[int]
    ref: ManifestRef
    canonical_json: bytes
    def __init__(self, ref: _Optional[_Union[ManifestRef, _Mapping]] = ..., canonical_json: _Optional[bytes] = ...) -> None: ...

class ManifestSelector(_message.Message):
    __slots__ = ("sha256", "by_name")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BY_NAME_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    by_name: ManifestNameRef
    def __init__(self, sha256: _Optional[str] = ..., by_name: _Optional[_Union[ManifestNameRef, _Mapping]] = ...) -> None: ...

class ManifestNameRef(_message.Message):
    __slots__ = ("name", "policy_generation")
    NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_GENERATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    policy_generation: int
    def __init__(self, name: _Optional[str] = ..., policy_generation: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Generations(_message.Message):
    __slots__ = ("request_generation", "state_generation", "parent_state_generation", "cache_generation")
    REQUEST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PARENT_STATE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    request_generation: int
    state_generation: int
    parent_state_generation: int
    cache_generation: int
    def __init__(self, request_generation: _Optional[int] = ..., state_generation: _Optional[int] = ..., parent_state_generation: _Optional[int] = ..., cache_generation: _Optional[int] = ...) -> None: ...

class Fence(_message.Message):
    __slots__ = ("request_id", "request_generation", "state_generation", "cache_generation", "receipt_digest", "manifest_sha256", "phase", "prefill_worker", "decode_worker", "updated_at_unix_ms", "lease_remaining_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_generation: int
    state_generation: int
    cache_generation: int
    receipt_digest: str
    manifest_sha256: str
    phase: Phase
    prefill_worker: str
    decode_worker: str
    updated_at_unix_ms: int
    lease_remaining_ms: int
    def __init__(self, request_id: _Optional[str] = ..., request_generation: _Optional[int] = ..., state_generation: _Optional[int] = ..., cache_generation: _Optional[int] = ..., receipt_digest: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., updated_at_unix_ms: _Optional[int] = ..., lease_remaining_ms: _Optional[int] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("digest", "manifest_sha256", "generations", "frontier", "position_origin", "retained_rows", "omitted_rows", "owner_budgets", "payload_hash", "payload_digests")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_FIELD_NUMBER: _ClassVar[int]
    POSITION_ORIGIN_FIELD_NUMBER: _ClassVar[int]
    RETAINED_ROWS_FIELD_NUMBER: _ClassVar[int]
    OMITTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    OWNER_BUDGETS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_HASH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    manifest_sha256: str
    generations: Generations
    frontier: int
    position_origin: int
    retained_rows: int
    omitted_rows: int
    owner_budgets: _containers.RepeatedScalarFieldContainer[int]
    payload_hash: str
    payload_digests: _containers.RepeatedCompositeFieldContainer[PayloadDigest]
    def __init__(self, digest: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., generations: _Optional[_Union[Generations, _Mapping]] = ..., frontier: _Optional[int] = ..., position_origin: _Optional[int] = ..., retained_rows: _Optional[int] = ..., omitted_rows: _Optional[int] = ..., owner_budgets: _Optional[_Iterable[int]] = ..., payload_hash: _Optional[str] = ..., payload_digests: _Optional[_Iterable[_Union[PayloadDigest, _Mapping]]] = ...) -> None: ...

class PayloadDigest(_message.Message):
    __slots__ = ("k", "v")
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    k: str
    v: str
    def __init__(self, k: _Optional[str] = ..., v: _Optional[str] = ...) -> None: ...

class Ledger(_message.Message):
    __slots__ = ("bytes_per_row", "full_payload_bytes", "visible_payload_bytes", "position_map_bytes", "row_offsets_bytes", "transaction_peak_bytes", "unique_demand_bytes", "query_expanded_demand_bytes", "bytes_moved", "recalled_bytes", "page_summary_bytes", "host_tier_bytes", "num_layers", "num_owners", "owners_are_query_heads", "prompt_rows", "visible_rows", "unique_kv_rows", "query_expanded_rows", "source_rows", "observation_bytes", "score_bytes", "score_workspace_bytes", "allocator_workspace_bytes", "selection_workspace_bytes", "compaction_workspace_bytes", "code_table_bytes")
    BYTES_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    FULL_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    POSITION_MAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSETS_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSACTION_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_DEMAND_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUERY_EXPANDED_DEMAND_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    RECALLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SUMMARY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_OWNERS_FIELD_NUMBER: _ClassVar[int]
    OWNERS_ARE_QUERY_HEADS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROWS_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_KV_ROWS_FIELD_NUMBER: _ClassVar[int]
    QUERY_EXPANDED_ROWS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ROWS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCORE_WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SELECTION_WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODE_TABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes_per_row: int
    full_payload_bytes: int
    visible_payload_bytes: int
    position_map_bytes: int
    row_offsets_bytes: int
    transaction_peak_bytes: int
    unique_demand_bytes: int
    query_expanded_demand_bytes: int
    bytes_moved: int
    recalled_bytes: int
    page_summary_bytes: int
    host_tier_bytes: int
    num_layers: int
    num_owners: int
    owners_are_query_heads: bool
    prompt_rows: int
    visible_rows: int
    unique_kv_rows: int
    query_expanded_rows: int
    source_rows: int
    observation_bytes: int
    score_bytes: int
    score_workspace_bytes: int
    allocator_workspace_bytes: int
    selection_workspace_bytes: int
    compaction_workspace_bytes: int
    code_table_bytes: int
    def __init__(self, bytes_per_row: _Optional[int] = ..., full_payload_bytes: _Optional[int] = ..., visible_payload_bytes: _Optional[int] = ..., position_map_bytes: _Optional[int] = ..., row_offsets_bytes: _Optional[int] = ..., transaction_peak_bytes: _Optional[int] = ..., unique_demand_bytes: _Optional[int] = ..., query_expanded_demand_bytes: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., recalled_bytes: _Optional[int] = ..., page_summary_bytes: _Optional[int] = ..., host_tier_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_owners: _Optional[int] = ..., owners_are_query_heads: _Optional[bool] = ..., prompt_rows: _Optional[int] = ..., visible_rows: _Optional[int] = ..., unique_kv_rows: _Optional[int] = ..., query_expanded_rows: _Optional[int] = ..., source_rows: _Optional[int] = ..., observation_bytes: _Optional[int] = ..., score_bytes: _Optional[int] = ..., score_workspace_bytes: _Optional[int] = ..., allocator_workspace_bytes: _Optional[int] = ..., selection_workspace_bytes: _Optional[int] = ..., compaction_workspace_bytes: _Optional[int] = ..., code_table_bytes: _Optional[int] = ...) -> None: ...

class RetentionSummary(_message.Message):
    __slots__ = ("prompt_method", "decode_method", "positions", "budget_rows", "resident_max", "score_state_bytes_per_row", "score_state_bytes", "layout", "evicted_rows", "publications")
    PROMPT_METHOD_FIELD_NUMBER: _ClassVar[int]
    DECODE_METHOD_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_ROWS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_MAX_FIELD_NUMBER: _ClassVar[int]
    SCORE_STATE_BYTES_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    SCORE_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    PUBLICATIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_method: str
    decode_method: str
    positions: str
    budget_rows: int
    resident_max: int
    score_state_bytes_per_row: int
    score_state_bytes: int
    layout: str
    evicted_rows: int
    publications: int
    def __init__(self, prompt_method: _Optional[str] = ..., decode_method: _Optional[str] = ..., positions: _Optional[str] = ..., budget_rows: _Optional[int] = ..., resident_max: _Optional[int] = ..., score_state_bytes_per_row: _Optional[int] = ..., score_state_bytes: _Optional[int] = ..., layout: _Optional[str] = ..., evicted_rows: _Optional[int] = ..., publications: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_id", "text", "index", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    index: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("reason", "field", "message", "current")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    reason: ErrorReason
    field: str
    message: str
    current: Fence
    def __init__(self, reason: _Optional[_Union[ErrorReason, str]] = ..., field: _Optional[str] = ..., message: _Optional[str] = ..., current: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...
