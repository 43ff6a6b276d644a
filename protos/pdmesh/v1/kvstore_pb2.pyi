from protos.pdmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutRequest(_message.Message):
    __slots__ = ("model_fingerprint", "block_hashes", "parent_hash", "source")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    source: _common_pb2.KVHandle
    def __init__(self, model_fingerprint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ..., source: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored_block_hashes", "num_blocks_read")
    STORED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_READ_FIELD_NUMBER: _ClassVar[int]
    stored_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_blocks_read: int
    def __init__(self, stored_block_hashes: _Optional[_Iterable[int]] = ..., num_blocks_read: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model_fingerprint", "block_hashes")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_fingerprint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_prefix_blocks", "tiers")
    NUM_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    num_prefix_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    def __init__(self, num_prefix_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("model_fingerprint", "block_hashes", "requester_agent_name", "layout_fingerprint", "request_id")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    requester_agent_name: str
    layout_fingerprint: str
    request_id: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., requester_agent_name: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("num_prefix_blocks", "kv_handle")
    NUM_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    num_prefix_blocks: int
    kv_handle: _common_pb2.KVHandle
    def __init__(self, num_prefix_blocks: _Optional[int] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "num_blocks_unpinned")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_UNPINNED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    num_blocks_unpinned: int
    def __init__(self, released: _Optional[bool] = ..., num_blocks_unpinned: _Optional[int] = ...) -> None: ...

class KVStoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVStoreTierStats(_message.Message):
    __slots__ = ("tier", "num_blocks_total", "num_blocks_used")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.Tier
    num_blocks_total: int
    num_blocks_used: int
    def __init__(self, tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_used: _Optional[int] = ...) -> None: ...

class KVStoreStats(_message.Message):
    __slots__ = ("store_id", "block_size", "tiers", "num_lookups", "num_blocks_hit", "num_blocks_requested", "model_fingerprint", "layout_fingerprint", "num_puts", "num_blocks_put", "num_blocks_declined", "num_blocks_demoted", "num_blocks_dropped", "num_blocks_promoted", "num_leases", "num_fetches")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_HIT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_PUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_PUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_DECLINED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_FETCHES_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    block_size: int
    tiers: _containers.RepeatedCompositeFieldContainer[KVStoreTierStats]
    num_lookups: int
    num_blocks_hit: int
    num_blocks_requested: int
    model_fingerprint: str
    layout_fingerprint: str
    num_puts: int
    num_blocks_put: int
    num_blocks_declined: int
    num_blocks_demoted: int
    num_blocks_dropped: int
    num_blocks_promoted: int
    num_leases: int
    num_fetches: int
    def __init__(self, store_id: _Optional[str] = ..., block_size: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[KVStoreTierStats, _Mapping]]] = ..., num_lookups: _Optional[int] = ..., num_blocks_hit: _Optional[int] = ..., num_blocks_requested: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., num_puts: _Optional[int] = ..., num_blocks_put: _Optional[int] = ..., num_blocks_declined: _Optional[int] = ..., num_blocks_demoted: _Optional[int] = ..., num_blocks_dropped: _Optional[int] = ..., num_blocks_promoted: _Optional[int] = ..., num_leases: _Optional[int] = ..., num_fetches: _Optional[int] = ...) -> None: ...
