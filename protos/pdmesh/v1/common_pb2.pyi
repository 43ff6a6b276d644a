from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_CPU: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_CPU: Tier
TIER_DISK: Tier
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens", "logit_bias", "min_tokens", "allowed_token_ids", "include_stop_str_in_output", "prompt_logprobs", "structured_outputs", "priority", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    skip_special_tokens: bool
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    prompt_logprobs: int
    structured_outputs: StructuredOutputs
    priority: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., skip_special_tokens: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., priority: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "disable_any_whitespace", "think_start_token", "think_end_token", "whitespace_pattern")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    THINK_START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    THINK_END_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    disable_any_whitespace: bool
    think_start_token: int
    think_end_token: int
    whitespace_pattern: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ..., think_start_token: _Optional[int] = ..., think_end_token: _Optional[int] = ..., whitespace_pattern: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("block_hashes", "tier", "parent_hash")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    parent_hash: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ..., parent_hash: _Optional[int] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ("tier",)
    TIER_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("blocks_stored", "blocks_removed", "all_blocks_cleared")
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    blocks_stored: BlocksStored
    blocks_removed: BlocksRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, blocks_stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., blocks_removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "model_fingerprint", "seq", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_fingerprint: str
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, worker_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("worker_id", "worker_address", "agent_name", "block_ids", "layout_fingerprint", "num_tokens", "lease_deadline_unix_ms", "request_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    worker_address: str
    agent_name: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout_fingerprint: str
    num_tokens: int
    lease_deadline_unix_ms: int
    request_id: str
    def __init__(self, worker_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., agent_name: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., layout_fingerprint: _Optional[str] = ..., num_tokens: _Optional[int] = ..., lease_deadline_unix_ms: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class TransferMetadataRequest(_message.Message):
    __slots__ = ("requester_agent_name", "layout_fingerprint", "agent_name")
    REQUESTER_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    requester_agent_name: str
    layout_fingerprint: str
    agent_name: str
    def __init__(self, requester_agent_name: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., agent_name: _Optional[str] = ...) -> None: ...

class TransferMetadata(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "layout_fingerprint", "block_nbytes", "num_blocks", "pool_base_address", "device", "mem_type")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    layout_fingerprint: str
    block_nbytes: int
    num_blocks: int
    pool_base_address: int
    device: str
    mem_type: str
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout_fingerprint: _Optional[str] = ..., block_nbytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., pool_base_address: _Optional[int] = ..., device: _Optional[str] = ..., mem_type: _Optional[str] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("role", "worker_id", "model_fingerprint", "block_size", "num_kv_blocks_total", "num_kv_blocks_free", "num_running", "num_waiting", "running_tokens", "queued_tokens", "kv_usage", "draining", "layout_fingerprint", "max_model_len", "lora_adapters")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    worker_id: str
    model_fingerprint: str
    block_size: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    num_running: int
    num_waiting: int
    running_tokens: int
    queued_tokens: int
    kv_usage: float
    draining: bool
    layout_fingerprint: str
    max_model_len: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., worker_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., num_kv_blocks_free: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., running_tokens: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., kv_usage: _Optional[float] = ..., draining: _Optional[bool] = ..., layout_fingerprint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...
