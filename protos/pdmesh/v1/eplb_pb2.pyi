from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertLoadReport(_message.Message):
    __slots__ = ("worker_id", "model_fingerprint", "ep_rank", "step", "num_layers", "num_physical_experts", "counts", "placement_version", "num_logical_experts", "num_ranks", "pool", "physical_to_logical")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_TO_LOGICAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_fingerprint: str
    ep_rank: int
    step: int
    num_layers: int
    num_physical_experts: int
    counts: _containers.RepeatedScalarFieldContainer[int]
    placement_version: int
    num_logical_experts: int
    num_ranks: int
    pool: str
    physical_to_logical: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., ep_rank: _Optional[int] = ..., step: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_physical_experts: _Optional[int] = ..., counts: _Optional[_Iterable[int]] = ..., placement_version: _Optional[int] = ..., num_logical_experts: _Optional[int] = ..., num_ranks: _Optional[int] = ..., pool: _Optional[str] = ..., physical_to_logical: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertLoadAck(_message.Message):
    __slots__ = ("placement_version", "accepted")
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    placement_version: int
    accepted: bool
    def __init__(self, placement_version: _Optional[int] = ..., accepted: _Optional[bool] = ...) -> None: ...

class PlacementRequest(_message.Message):
    __slots__ = ("model_fingerprint", "after_version", "num_layers", "num_physical_experts", "num_logical_experts", "num_ranks", "pool")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    after_version: int
    num_layers: int
    num_physical_experts: int
    num_logical_experts: int
    num_ranks: int
    pool: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., after_version: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_physical_experts: _Optional[int] = ..., num_logical_experts: _Optional[int] = ..., num_ranks: _Optional[int] = ..., pool: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("version", "num_layers", "num_physical_experts", "num_logical_experts", "physical_to_logical", "model_fingerprint", "num_ranks", "pool", "balancedness_before", "balancedness_after")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_TO_LOGICAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_AFTER_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_layers: int
    num_physical_experts: int
    num_logical_experts: int
    physical_to_logical: _containers.RepeatedScalarFieldContainer[int]
    model_fingerprint: str
    num_ranks: int
    pool: str
    balancedness_before: float
    balancedness_after: float
    def __init__(self, version: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_physical_experts: _Optional[int] = ..., num_logical_experts: _Optional[int] = ..., physical_to_logical: _Optional[_Iterable[int]] = ..., model_fingerprint: _Optional[str] = ..., num_ranks: _Optional[int] = ..., pool: _Optional[str] = ..., balancedness_before: _Optional[float] = ..., balancedness_after: _Optional[float] = ...) -> None: ...
